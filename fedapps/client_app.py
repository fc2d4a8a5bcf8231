"""Postcard's registered ClientApp: read the run's config, open the node's session, call the method.

Every method answers through this one preamble (``fedapps.method``): the config the server
sent, the session of this node (model built by the method's ``prepare``, task of its
partition), then the method's ``train`` or ``evaluate``; the reply carries the metrics
with this node's ``partition-id``.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.assets import force_offline
from fedapps import registry
from fedapps.method import ClientCall
from fedapps.session import client_config, reply, session

force_offline()
app = ClientApp()


def _call(msg: Message, context: Context):
    cfg = client_config(msg, context)
    method = registry.get(cfg.algorithm.name)
    return method, ClientCall(msg, context, cfg, session(cfg, context, method.prepare))


@app.train()
def train(msg: Message, context: Context) -> Message:
    method, call = _call(msg, context)
    update = method.train(call)
    update.metrics["partition-id"] = call.session.partition_id
    out = reply(msg, update.metrics, update.arrays)
    for name, record in update.records.items():
        out.content[name] = record
    return out


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    method, call = _call(msg, context)
    metrics = method.evaluate(call)
    metrics["partition-id"] = call.session.partition_id
    return reply(msg, metrics)
