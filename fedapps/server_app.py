"""Postcard's registered ServerApp: compose the config, run the chosen algorithm's server.

Flower logs any exception of a ServerApp with its whole traceback. A run refused for a reason
the user can fix (a bad config, no SmartFed pool, too few SuperNodes, a resume folder that does
not fit) is logged as one line instead: the error's own message names the fix.
"""

from __future__ import annotations

import logging
from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedapps import registry
from fedapps.checkpoint import ResumeError
from fedapps.config import compose_from_run_config
from fedapps.errors import NODE_ERRORS
from fedapps.runner import NoReplies, ServerSetupError, run_server
from strategies.screening import ClientsFailed

# errors whose message says what to change: logged in one line, without a traceback (and each method's own:
# its record's ``errors``, see user_errors); ClientsFailed carries the clients' own one-line reason
USER_ERRORS = (*NODE_ERRORS, ServerSetupError, NoReplies, ResumeError, ClientsFailed)


def user_errors() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS` and every registered method's own (``Method.errors``)."""
    return USER_ERRORS + tuple(error for method in registry.METHODS.values() for error in method.errors)


class OneLineUserErrors(logging.Filter):
    """Turn Flower's "ServerApp raised an exception" + traceback into one line for :func:`user_errors`."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, user_errors()):
            record.msg, record.args = f"{record.getMessage()}: {error}", ()
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("flwr").addFilter(OneLineUserErrors())
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    from fedapps.pulls import prompt_object_pulls

    log(INFO, "ServerApp: %s", prompt_object_pulls())  # a reply's objects: retried promptly (docs/deploy.md §9)
    run_server(grid, compose_from_run_config(context.run_config))
