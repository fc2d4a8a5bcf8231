"""End to end: a Flower simulation (Ray, tiny Llama) in which one client misbehaves every round.

The hostile client is Postcard's own ClientApp wrapped in a Flower mod that corrupts its
replies: round 1 a training payload full of NaN (refused), round 2 an update 1,000x its
real size (accepted, clipped to the norm bound), and every evaluation a NaN perplexity
(refused). The run must finish, learn, record each refusal and bound with the node, round,
kind and reason in metrics.jsonl, and count them by kind in summary.json.
"""

import numpy as np
import pytest
from flwr.app import Message
from flwr.clientapp import ClientApp

from fedapps import client_app as postcard
from fedapps.config import compose
from fedapps.outputs import read_metrics
from fedapps.simulation import simulate
from strategies import codec

pytestmark = pytest.mark.slow


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


hostile = ClientApp(mods=[corrupt])
hostile.train()(postcard.train)
hostile.evaluate()(postcard.evaluate)


def test_one_hostile_client_neither_stops_nor_poisons_the_run(outputs, monkeypatch):
    import os
    import sys

    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, *sys.path]))  # Ray workers import this module
    cfg = compose(["rounds=2", "num_clients=3", "train.local_steps=4"], preset="test")
    summary = simulate(cfg, clients=hostile)
    rounds = read_metrics(summary["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2]
    node = {c["node_id"] for r in rounds for c in r["clients"] if c.get("eval_partition-id") == 0
            or c.get("train_partition-id") == 0}
    refused = [(r["round"], x["phase"], x["kind"], x["node_id"]) for r in rounds for x in r["refused"]]
    assert refused and {n for *_, n in refused} <= node, refused
    assert sorted((rnd, phase, kind) for rnd, phase, kind, _ in refused) == [
        (0, "eval", "metrics"), (1, "eval", "metrics"), (1, "train", "payload"), (2, "eval", "metrics")]
    assert all(x["reason"] for r in rounds for x in r["refused"])
    bounded = [(r["round"], b["kind"]) for r in rounds for b in r["bounded"]]
    assert bounded == [(2, "norm-clipped")]
    assert summary["refused_by_kind"] == {"metrics": 3, "payload": 1}
    assert summary["bounded_by_kind"] == {"norm-clipped": 1}
    # the model still learns, and the reported metric is the honest clients'
    assert np.isfinite(summary["final_metric"]) and summary["final_metric"] < summary["initial_metric"]
