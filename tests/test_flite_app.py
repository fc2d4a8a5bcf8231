"""FLITE through Flower: latent-only payloads, fingerprint checks, and a run that learns."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedapps.config import compose
from strategies import codec
from strategies.flite import FliteStrategy


def strategy(n=1280, fmt="int4", uplink="absolute", **kw):
    return FliteStrategy(fingerprint="abcd", initial_state={"z": np.zeros(n, np.float32)}, config_yaml="x: 1\n",
                         num_clients=2, uplink_format=fmt, downlink_format=fmt, uplink=uplink, **kw)


def reply(node, z, fp="abcd", fmt="int4", n=10):
    request = Message(RecordDict({}), dst_node_id=node, message_type="train")
    content = RecordDict({"arrays": codec.encode({"z": z}, fmt), "metrics": MetricRecord({"num-examples": n}),
                          "flite": ConfigRecord({"fingerprint": fp})})
    return Message(content, reply_to=request)


def test_int4_latents_are_648_bytes_and_averaged():
    s = strategy()
    a, b = np.linspace(-1, 1, 1280).astype(np.float32), np.linspace(1, -1, 1280).astype(np.float32)
    assert codec.payload_bytes(codec.encode({"z": a}, "int4")) == 648
    arrays, _ = s.aggregate_train(1, [reply(1, a), reply(2, b)])
    z = codec.decode(arrays)["z"]
    step = 2 / 15
    assert np.max(np.abs(z - 0.0)) <= step / 2 + 1e-6  # mean of a and -a, each within half a step
    assert s.round_record()["clients"]["1"]["uplink_payload_bytes"] == 648
    assert codec.payload_bytes(s.downlink_arrays()) == 648


def test_delta_uplink_adds_the_mean_update_to_the_fp32_global_latents():
    from strategies.robust import Robustness

    # robust=off: the example-weighted mean update exactly (the defaults cap 3 examples at 1, clip 0.4 to 1.5 x 0.1)
    s = strategy(n=4, fmt="fp32", uplink="delta",
                 robustness=Robustness.off())
    s.global_state["z"] = np.array([1, 2, 3, 4], np.float32)
    arrays, _ = s.aggregate_train(1, [reply(1, np.full(4, 0.1, np.float32), fmt="fp32", n=1),
                                      reply(2, np.full(4, 0.4, np.float32), fmt="fp32", n=3)])
    assert np.allclose(codec.decode(arrays)["z"], [1.325, 2.325, 3.325, 4.325])


@pytest.mark.parametrize("bad, reason", [
    (dict(fp="ffff"), "fingerprint"),
    (dict(z=np.zeros(1279, np.float32)), "has shape"),
    (dict(z=np.full(1280, np.nan, np.float32), fmt="fp32"), "NaN"),
    (dict(), "must be finite"),
])
def test_mismatched_wrong_length_or_nan_latents_are_refused(bad, reason):
    s = strategy()
    before = s.global_state["z"].copy()
    z = bad.pop("z", np.ones(1280, np.float32))
    if reason == "NaN":  # an fp32 latent in an int4 run is refused as such
        msg = reply(3, np.ones(1280, np.float32), fmt="fp32")
        reason = "wire format"
    elif reason == "must be finite":  # an int4 latent whose scale is NaN
        import struct

        from flwr.app import Array

        msg = reply(3, np.ones(1280, np.float32))
        msg.content["arrays"]["z"] = Array(dtype="float32", shape=(1280,), stype=codec.INT4,
                                           data=bytes(640) + struct.pack("<ff", float("nan"), 0.0))
    else:
        msg = reply(3, z, **bad)
    arrays, _ = s.aggregate_train(1, [msg])
    assert arrays is None and np.array_equal(s.global_state["z"], before)
    assert reason in s.round_record()["refused"][0]["reason"]


def test_the_vision_backbone_gets_1280_latents_and_a_frozen_orthogonal_head():
    import torch

    from fedapps.flite import prepare

    cfg = compose(task="cifar10", algorithm="flite")
    model, _, extra = prepare(cfg)
    assert extra["latents"] == 1280
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("flite_z" in n for n in trainable)
    w = model.head.weight
    assert torch.allclose(w @ w.T, torch.eye(w.shape[0]), atol=1e-5)


@pytest.mark.slow
def test_flite_simulation_from_a_task_pretrained_base_with_int4_payloads_learns(outputs):
    """base=public: the server builds θ_pre on the public split (or reuses it), every client
    loads it with its head; FLITE's int4 latents then improve on θ_pre."""
    from clients.pretrain import read_report
    from fedapps.outputs import read_metrics
    from inprocess import run as simulate  # run_server in this process (#40: no Ray start)

    cfg = compose(
        ["model=tiny-cnn", "partition=iid", "rounds=3", "train.local_steps=15", "train.batch_size=32",
         "train.lr=0.05", "eval.max_batches=4", "eval.batch_size=64", "task.max_examples=2000",
         "algorithm.flite.latent_budget=256", "num_clients=2", "base=public", "base.steps=40", "base.lr=3e-3",
         "base.batch_size=32"],
        task="fmnist", algorithm="flite", preset="none",
    )
    summary = simulate(cfg)
    base = read_report(cfg)
    assert base["accuracy_after"] > base["accuracy_before"] + 0.1  # θ_pre knows the task
    assert summary["refused_replies"] == 0
    assert summary["uplink_bytes_per_client_round"] == (256 + 1) // 2 + 8
    assert summary["initial_metric"] > 0.25  # round 0 evaluates θ_pre, not a random init
    losses = [record["eval"]["loss"] for record in read_metrics(summary["run_dir"])]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.03  # the held-out loss falls below θ_pre's
    assert summary["final_metric"] > summary["initial_metric"] - 0.05  # (accuracy on 400 images is noisy)
    # the final model from the run folder (factors regenerated, z as the clients hold it) scores what the
    # run recorded; merged into the backbone's own weights it is a plain tiny CNN with the same accuracy
    from clients.models import vision_model
    from clients.tasks import make_task
    from clients.train import evaluate
    from fedapps.final import load_run

    final = load_run(summary["run_dir"])
    assert final.evaluate()["aggregate"]["accuracy"] == pytest.approx(summary["final_metric"], rel=1e-9)
    plain = vision_model(cfg, final.export(outputs / "merged") / "model.safetensors")
    task = make_task(cfg, 0, 2)
    assert evaluate(plain, task, cfg.eval)["accuracy"] == evaluate(final.model, task, cfg.eval)["accuracy"]


def test_wire_bytes_are_the_protobuf_requests_flower_builds_for_a_reply():
    """codec.wire_bytes equals the serialised length of what Flower's own push helpers send:
    the PushMessagesRequest (metadata + object tree) and each object's PushObjectRequest."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import PushObjectResponse
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import push_objects

    z = np.linspace(-1, 1, 1280).astype(np.float32)
    msg = reply(123456789, z)
    sent = []

    def stub(request):  # stands in for the gRPC stub: what would go on the wire
        sent.append(len(request.SerializeToString()))
        return PushObjectResponse(stored=True)

    node = Node(node_id=123456789)
    push_objects(get_all_nested_objects(msg), make_push_object_fn_protobuf(stub, node, msg.metadata.run_id, ""),
                 max_concurrent_pushes=1)
    head = PushMessagesRequest(node=node, messages_list=[message_to_proto(remove_content_from_message(msg))],
                               message_object_trees=[get_object_tree(msg)], clientapp_runtime_list=[0.0])
    assert len(sent) == 7  # message, record dict, 3 records, the array and its chunk
    assert codec.wire_bytes(msg) == sum(sent) + len(head.SerializeToString())
    assert codec.payload_bytes(msg.content["arrays"]) == 648 < codec.message_bytes(msg.content) < codec.wire_bytes(msg)


def test_block_wise_int4_latents_are_800_bytes_both_ways_and_averaged():
    """algorithm.payload=int4b / downlink=int4b: one scale per 64 latents (800 bytes for 1,280);
    a reply in the single-scale int4 format is refused, the global latents follow the mean update."""
    s = strategy(fmt="int4b", uplink="delta")
    rng = np.random.default_rng(0)
    # one block of tiny updates beside blocks of large ones: its own scale keeps it
    a = (rng.standard_normal(1280) * np.where(np.arange(1280) < 64, 1e-4, 1e-1)).astype(np.float32)
    arrays, _ = s.aggregate_train(1, [reply(1, a, fmt="int4b"), reply(2, a, fmt="int4b"),
                                      reply(3, a, fmt="int4")])
    assert s.round_record()["clients"]["1"]["uplink_payload_bytes"] == 800
    assert s.round_record()["refused"] and "wire format" in str(s.round_record()["refused"])
    z = codec.decode(arrays)["z"]
    assert codec.payload_bytes(s.downlink_arrays()) == 800 and s.downlink_arrays()["z"].stype == codec.INT4B
    small = float(np.abs(a[:64]).max())
    assert np.abs(z[:64] - a[:64]).max() <= 2 * small / 15 + 1e-9  # within one step of the block's own range
    one_scale = codec.decode(codec.encode({"z": a}, "int4"))["z"]
    assert np.abs(one_scale[:64] - a[:64]).max() > 10 * np.abs(z[:64] - a[:64]).max()


# ---------------------------------------------------------------------------- the compact reply
def compact_strategy(**kw):
    return FliteStrategy(fingerprint="abcd", initial_state={"z": np.zeros(1280, np.float32)}, config_yaml="x: 1\n",
                         num_clients=2, uplink_format="int4", downlink_format="int4", uplink="delta",
                         reply="compact", **kw)


def compact_reply(node, latents, n=10, **changes):
    from strategies.flite import compact_content

    content = compact_content(codec.encode({"z": latents}, "int4"), n)
    for key, value in changes.items():
        content["z"][key] = value
    return Message(content, reply_to=Message(RecordDict({}), dst_node_id=node, message_type="train"))


def test_a_compact_reply_is_flowers_floor_plus_its_count_and_averages_exactly_as_a_full_one():
    a, b = np.linspace(-0.1, 0.1, 1280).astype(np.float32), np.linspace(0.2, -0.05, 1280).astype(np.float32)
    full, compact = strategy(uplink="delta"), compact_strategy()
    arrays_full, _ = full.aggregate_train(1, [reply(1, a, n=10), reply(2, b, n=30)])
    arrays_compact, _ = compact.aggregate_train(1, [compact_reply(1, a, 10), compact_reply(2, b, 30)])
    assert np.array_equal(full.global_state["z"], compact.global_state["z"])
    assert np.array_equal(codec.decode(arrays_full)["z"], codec.decode(arrays_compact)["z"])
    client = compact.round_record()["clients"]["1"]
    assert client["uplink_payload_bytes"] == 648 and client["train_num-examples"] == 10
    assert client["uplink_wire_bytes"] == codec.wire_bytes(compact_reply(1, a, 10))
    # Postcard's share beyond Flower's floor (z's bytes alone in one record) is num-examples: ~20 bytes
    floor = compact_reply(1, a, 10)
    del floor.content["z"]["num-examples"]
    assert 0 < client["uplink_wire_bytes"] - codec.wire_bytes(floor) <= 24
    assert full.round_record()["clients"]["1"]["uplink_wire_bytes"] - client["uplink_wire_bytes"] > 1200


@pytest.mark.parametrize("make, reason", [
    (lambda z: reply(1, z), "this run's replies are compact"),  # a full reply in a compact run
    (lambda z: compact_reply(1, z, extra=1), "holds 'z' (bytes) and 'num-examples'"),
    (lambda z: compact_reply(1, z, z="not bytes"), "holds 'z' (bytes)"),
    (lambda z: compact_reply(1, z, z=b"\0" * 647), "carries 647 bytes"),
    (lambda z: compact_reply(1, z, **{"num-examples": 0}), "positive integer"),
    (lambda z: compact_reply(1, z, **{"num-examples": "10"}), "positive integer"),
    (lambda z: compact_reply(1, z, **{"num-examples": True}), "positive integer"),
])
def test_a_malformed_compact_reply_is_refused_and_the_state_is_unchanged(make, reason):
    s = compact_strategy()
    arrays, _ = s.aggregate_train(1, [make(np.ones(1280, np.float32) * 0.1)])
    assert arrays is None and not s.global_state["z"].any()
    assert reason in s.round_record()["refused"][0]["reason"], s.round_record()["refused"]


def test_a_full_run_refuses_a_compact_reply_and_compact_is_refused_with_secure_aggregation():
    s = strategy(uplink="delta")
    s.aggregate_train(1, [compact_reply(1, np.ones(1280, np.float32) * 0.1)])
    assert "but this run's replies are full" in s.round_record()["refused"][0]["reason"]
    from fedapps.config import ConfigError

    with pytest.raises(ConfigError, match="compact reply"):
        compose(["algorithm.reply=compact", "secure_aggregation.enabled=true"], algorithm="flite", preset="test")
    with pytest.raises(ConfigError, match="algorithm.reply must be one of"):
        compose(["algorithm.reply=tiny"], algorithm="flite", preset="test")


def test_compact_clients_train_and_the_server_learns_from_their_replies():
    """The real ClientApp in this process: compact replies (z's bytes + num-examples, nothing else)
    move the model as full replies do, and a client refuses a server of another parametrisation."""
    from fedapps import registry
    from fedapps.config import to_yaml
    from inprocess import context, evaluate_round, train_round

    cfg = compose(["algorithm.reply=compact", "train.local_steps=3"], algorithm="flite", preset="test")
    strategy = registry.get("flite").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    nodes = {1: context(1), 2: context(2)}
    losses = [evaluate_round(cfg, strategy, 0, nodes)["loss"]]
    for server_round in (1, 2):
        replies = train_round(cfg, strategy, server_round, nodes)
        assert [sorted(r.content) for r in replies] == [["z"], ["z"]]
        assert [sorted(r.content["z"]) for r in replies] == [["num-examples", "z"]] * 2
        strategy.aggregate_train(server_round, replies)
        assert not strategy.round_record()["refused"]
        losses.append(evaluate_round(cfg, strategy, server_round, nodes)["loss"])
    assert losses[-1] < losses[0], losses
    strategy.fingerprint = "0" * 16  # a server of another parametrisation: the client refuses to train
    from fedapps.session import ClientSetupError

    with pytest.raises(ClientSetupError, match="fingerprint 0000000000000000 differs"):
        train_round(cfg, strategy, 3, {1: nodes[1]})
