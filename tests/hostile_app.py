"""Postcard's own ClientApp with one misbehaving client: a Flower mod corrupts the replies of
the node with partition id 0 (tests/test_hostile_run.py; also a Flower app of its own there,
for `flwr run`).

Round 1 its training payload is full of NaN (to be refused), round 2 its update is 1,000x
what it trained (to be clipped), and every evaluation reports a NaN perplexity (refused).
"""

import numpy as np
from flwr.app import Message
from flwr.clientapp import ClientApp

from fedapps import client_app as postcard
from strategies import codec


def corrupt(msg: Message, context, call_next) -> Message:
    reply = call_next(msg, context)
    if int(context.node_config["partition-id"]) != 0 or reply.has_error():
        return reply
    server_round = int(msg.content["config"]["server-round"])
    if msg.metadata.message_type == "train":
        sent = codec.decode(msg.content["arrays"])
        mine = codec.decode(reply.content["arrays"])
        if server_round == 1:
            key = sorted(mine)[0]
            record = reply.content["arrays"]
            record[key] = codec.fp32_array(mine[key].shape, np.zeros_like(mine[key]))
            record[key].data = np.full(mine[key].size, np.nan, "<f4").tobytes()
        else:
            scaled = {k: sent[k] + 1000.0 * (mine[k] - sent[k]) for k in mine}
            reply.content["arrays"] = codec.encode(scaled)
    else:
        reply.content["metrics"]["perplexity"] = float("nan")
    return reply


app = ClientApp(mods=[postcard.transport_packing, corrupt])  # corrupt works on the unpacked reply
app.train()(postcard.train)
app.evaluate()(postcard.evaluate)
