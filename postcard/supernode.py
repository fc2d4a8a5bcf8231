"""A prompt SuperNode: ``flower-supernode`` with shorter waits, for nodes served by the warm worker.

    python -m postcard.supernode [--idle-poll 0.5] [--reply-poll 0.05] <flower-supernode's arguments>

Flower 1.42's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps 3 s whenever
its pull finds no message for it (``time.sleep(3)``), and checks every 0.5 s whether its
ClientApp has replied (``time.sleep(0.5)``); neither is configurable. A round has two phases
(train, evaluate), and each waits on average half a poll for the next message after the
previous reply: about 3 s a round of waiting that is neither training nor moving bytes, 10%
of a 30-second round. This runs the same ``flower-supernode`` (``flwr.supernode.cli``) in the
same process with those two waits shortened (``--idle-poll``: asking the SuperLink for a
message more often while idle; ``--reply-poll``: noticing the ClientApp's reply sooner), and
with the object pulls of :mod:`fedapps.pulls`. Every other argument goes to Flower as it is.

It relies on Flower internals (the two ``time.sleep`` calls of that module), so like
:mod:`postcard.worker` it refuses another flwr in one line (exit status 2), and it checks
that the module still holds exactly those calls before it changes anything.
``postcard.loopback``'s cluster starts it for warm nodes (docs/deploy.md, section 9).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

from fedapps.pulls import prompt_object_pulls
from postcard.worker import check_flwr

IDLE = 3  # flwr 1.42's sleep when a pull finds no message
REPLY = 0.5  # its sleep between looks for the ClientApp's reply


class _Waits:
    """Stands in for the ``time`` module inside Flower's SuperNode loop: its two fixed waits
    shortened, everything else passed through."""

    def __init__(self, idle: float, reply: float) -> None:
        self.idle, self.reply = idle, reply

    def sleep(self, seconds: float) -> None:
        time.sleep(self.idle if seconds == IDLE else self.reply if seconds == REPLY else seconds)

    def __getattr__(self, name: str):
        return getattr(time, name)


def shorten_waits(idle: float, reply: float) -> str:
    """Install the shorter waits in Flower's SuperNode loop; returns what it did, in one line.
    Raises RuntimeError when the loop does not look as this was written for."""
    from flwr.supernode import start_client_internal as loop

    source = inspect.getsource(loop)
    if source.count(f"time.sleep({IDLE})") != 1 or f"time.sleep({REPLY})" not in source:
        raise RuntimeError("flwr.supernode.start_client_internal no longer has the waits this was written for "
                           f"(time.sleep({IDLE}), time.sleep({REPLY})); run flower-supernode itself")
    loop.time = _Waits(idle, reply)
    return f"SuperNode waits: {idle:g} s when idle (Flower: {IDLE} s), {reply:g} s between looks for a reply " \
           f"(Flower: {REPLY} s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m postcard.supernode", description=__doc__.splitlines()[0],
                                     epilog="Every other argument is flower-supernode's.")
    parser.add_argument("--idle-poll", type=float, default=0.5,
                        help="seconds between asking the SuperLink for a message while idle (Flower: 3)")
    parser.add_argument("--reply-poll", type=float, default=0.05,
                        help="seconds between looks for the ClientApp's reply (Flower: 0.5)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if not (0 < args.idle_poll <= 60 and 0 < args.reply_poll <= 60):
        print("postcard supernode: --idle-poll and --reply-poll must be in (0, 60] seconds", file=sys.stderr)
        return 2
    refusal = check_flwr()
    if refusal:
        print(refusal.replace("postcard worker", "postcard supernode"), file=sys.stderr)
        return 2
    try:
        waits = shorten_waits(args.idle_poll, args.reply_poll)
    except RuntimeError as err:
        print(f"postcard supernode: {err}", file=sys.stderr)
        return 2
    print(f"[postcard-supernode] {waits}; {prompt_object_pulls()}", file=sys.stderr, flush=True)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
