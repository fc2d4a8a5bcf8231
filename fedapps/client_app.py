"""Postcard's registered ClientApp: hand each message to its algorithm's ClientApp."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.assets import force_offline
from fedapps import algorithms
from fedapps.session import client_config

force_offline()
app = ClientApp()


def _dispatch(msg: Message, context: Context) -> Message:
    cfg = client_config(msg, context)
    return algorithms.get(cfg.algorithm.name).clientapp(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _dispatch(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _dispatch(msg, context)
