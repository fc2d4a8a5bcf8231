"""Postcard's registered ClientApp: read the run's config, open the node's session, call the method.

Secure aggregation's extra stages (``train.secagg_*``) are answered by ``fedapps.secure``.

Every method answers through this one preamble (``fedapps.method``): the config the server
sent, the session of this node (model built by the method's ``prepare``, task of its
partition), then the method's ``train`` or ``evaluate``; the reply carries the metrics
with this node's ``partition-id`` and ``client-seconds`` (the whole message's work on the
node, the session included: bench/overhead.py takes Flower's share of a round from it).
Under secure aggregation or differential privacy the ``private_reply`` mod (``fedapps.private_reply``) clips,
noises or masks a training reply's update and leaves its metrics only ``num-examples: 1`` (docs/privacy.md
lists what a client still reveals).
"""

from __future__ import annotations

import time

from logging import ERROR

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from clients.assets import force_offline
from clients.train import progress_label
from fedapps import registry, secure
from fedapps.errors import NODE_ERRORS
from fedapps.private_reply import private_reply
from fedapps.method import ClientCall
from fedapps.session import client_config, reply, session
from strategies import packing
from strategies.secure_round import STAGES

force_offline()


def transport_packing(msg: Message, context: Context, call_next) -> Message:
    """A Flower mod: the server's packed arrays unpacked before the method sees them, the reply's
    packed after (strategies.packing: one array on the wire instead of one per tensor). A test
    app that wraps Postcard's handlers with mods of its own puts this one first."""
    if msg.has_content():
        msg.content = packing.unpack(msg.content)
    out = call_next(msg, context)
    if out.has_content():
        out.content = packing.pack(out.content)
    return out


def one_line_errors(msg: Message, context: Context, call_next) -> Message:
    """A Flower mod: a user's error found on the node (``fedapps.errors.NODE_ERRORS``: its data, model files or
    settings) becomes an error reply of one line, logged once on the node, so the server's log and
    ``summary.json`` say it in one line instead of a Ray traceback. Any other exception (a bug) keeps
    its traceback (Flower reports it)."""
    try:
        return call_next(msg, context)
    except NODE_ERRORS as err:
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        log(ERROR, "node %s: %s", context.node_id, reason)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


# outermost first: a user's error in one line; packed arrays on the wire; a private run's reply made private
app = ClientApp(mods=[one_line_errors, transport_packing, private_reply])


def _call(msg: Message, context: Context):
    cfg = secure.method_view(client_config(msg, context))
    method = registry.get(cfg.algorithm.name)
    return method, ClientCall(msg, context, cfg, session(cfg, context, method.prepare))


@app.train()
def train(msg: Message, context: Context) -> Message:
    start = time.perf_counter()
    method, call = _call(msg, context)
    # progress lines name the client (in a simulation Ray prefixes them with an actor's pid only)
    with progress_label(f" (client {call.session.partition_id}, node {context.node_id})"):
        update = method.train(call)
    if update.content is not None:  # the method's own reply form (secure aggregation and DP are refused with it)
        return Message(content=update.content, reply_to=msg)
    update.metrics["partition-id"] = call.session.partition_id
    update.metrics["client-seconds"] = time.perf_counter() - start  # this message's whole work on the node
    out = reply(msg, update.metrics, update.arrays)  # a private run's: made private by the private_reply mod
    for name, record in update.records.items():
        out.content[name] = record
    return out


# secure aggregation's stages (train.secagg_keys, _shares, _deliver, _open, _unmask): fedapps.secure answers each
for _stage in STAGES:
    app.train(_stage.split(".", 1)[1])(secure.answer_stage)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    start = time.perf_counter()
    method, call = _call(msg, context)
    metrics = method.evaluate(call)
    metrics["partition-id"] = call.session.partition_id
    metrics["client-seconds"] = time.perf_counter() - start
    return reply(msg, metrics)
