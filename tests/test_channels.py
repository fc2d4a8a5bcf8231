"""Channels: any method's updates through fp32 / int4 / top-k / PowerSGD / latents (fedapps.channel)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from inprocess import context, evaluate_round, fake_pool, train_round
from omegaconf import OmegaConf

from fedapps import registry
from fedapps.channel import CHANNELS, ChannelError, round_factors, server_channel, settings_of
from fedapps.latent import latent_training
from fedapps.config import ConfigError, choices, compose, to_yaml
from strategies import codec
from strategies.base import PayloadFedAvg
from strategies.channel import LATENT_KEY
from strategies.privacy import Privacy
from strategies.robust import Robustness
from strategies.secure_local import local_round
from strategies.secure_round import SecureSettings

torch.set_num_threads(1)


K = 20  # latents of the small layout below (at most 16 + 6 + 1 fit)


def latent_cfg(**kw):
    block = {"name": "latent", "latents": K, "format": "fp32", "split": "sqrt", "rank": 16, "scale": 1.0, "seed": 5}
    block.update(kw)
    return OmegaConf.create({"channel": block})


STATE = {"w": np.linspace(-1, 1, 96, dtype=np.float32).reshape(8, 12), "b": np.zeros(6, np.float32),
         "g": np.array(-4.0, np.float32)}


def latent_strategy(**kw):
    return PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=4, uplink="delta",
                         channel=server_channel(latent_cfg(), STATE), **kw)


def reply(node, z, examples=10):
    request = Message(RecordDict({}), dst_node_id=node, message_type="train")
    content = RecordDict({"arrays": codec.encode({LATENT_KEY: z}), "metrics": MetricRecord({"num-examples": examples})})
    return Message(content, reply_to=request)


def change(strategy):
    return {k: strategy.global_state[k].astype(np.float64) - STATE[k] for k in STATE}


# --------------------------------------------------------------------------- compose time
def test_every_method_and_channel_composes_or_is_refused_with_the_reason():
    for algorithm in choices("algorithm"):
        carried = compose(preset="test", algorithm=algorithm).algorithm.get("channels") or []
        for channel in CHANNELS:
            if channel == "method" or channel in carried:
                cfg = compose(preset="test", algorithm=algorithm, channel=channel)
                if channel != "method":
                    assert cfg.algorithm.payload == (cfg.channel.format if channel == "latent" else channel)
            else:
                with pytest.raises(ConfigError, match=f"cannot travel through channel '{channel}': .+"):
                    compose(preset="test", algorithm=algorithm, channel=channel)
    # the channel is the wire: format, uplink and compression follow it
    cfg = compose(["channel.topk_fraction=0.05"], preset="test", algorithm="fedavg-lora", channel="topk")
    assert (cfg.algorithm.payload, cfg.algorithm.uplink, cfg.algorithm.compression.topk_fraction) == ("topk", "delta", 0.05)
    assert compose(preset="test", algorithm="fednl", channel="int4").algorithm.uplink == "delta"
    with pytest.raises(ConfigError, match="secure_aggregation cannot carry .* top-k"):
        compose(["secure_aggregation.enabled=true"], preset="test", algorithm="fednl", channel="topk")
    with pytest.raises(ConfigError, match="channel.format must be fp32, int4 or int4b"):
        compose(["channel.format=int8"], preset="test", algorithm="fednl", channel="latent")
    cfg = compose(["channel.latents=100000"], preset="test", algorithm="fednl", channel="latent")
    with pytest.raises(ChannelError, match="exceeds"):  # more latents than θ's tensors can take: at server start
        registry.get("fednl").plan_server(cfg, on_round_end=None, config_yaml="")


# --------------------------------------------------------------------------- the latent channel, server side
def test_the_latent_mean_expands_to_the_mean_update_and_clients_and_server_agree():
    from strategies.robust import Robustness

    strategy = latent_strategy(robustness=Robustness.off())  # robust=off: the exact weighted mean (10, 20, 30 examples)
    channel = strategy.channel
    assert channel.layout() == {LATENT_KEY: (K,)} and strategy.spec.budget == 4 * K
    rng = np.random.default_rng(0)
    zs = {v: rng.normal(0, 0.1, K).astype(np.float32) for v in (1, 2, 3)}
    strategy.aggregate_train(1, [reply(v, z, examples=10 * v) for v, z in zs.items()])
    expected = {k: sum(10 * v * channel.expand(1, {LATENT_KEY: z})[k] for v, z in zs.items()) / 60 for k in STATE}
    for key in STATE:  # the averaging identity: mean of latents -> mean of the updates
        np.testing.assert_allclose(change(strategy)[key], expected[key], atol=1e-6)
    # every tensor moved, along its own orthonormal directions: ||ΔW_k|| = c_k ||z_k||
    z = channel.split(zs[1])
    delta = channel.expand(1, {LATENT_KEY: zs[1]})
    for key in STATE:
        m, n = (8, 12) if key == "w" else ((1, 6) if key == "b" else (1, 1))
        c = np.sqrt(m * n / channel.latents[key])
        assert np.linalg.norm(delta[key]) == pytest.approx(c * np.linalg.norm(z[key]), rel=1e-4)
    # another round, other directions
    assert not np.allclose(channel.expand(2, {LATENT_KEY: zs[1]})["w"], delta["w"])

    # a client's model: the same factors, so received + ΔW(z) is what the server adds
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.from_numpy(STATE["w"].copy()))
    model.sub = torch.nn.Module()
    model.sub.b = torch.nn.Parameter(torch.zeros(6))
    model.g = torch.nn.Parameter(torch.tensor(-4.0))
    names = ["w", "sub.b", "g"]
    call = SimpleNamespace(cfg=latent_cfg(), server_round=1)
    shapes = {"w": (8, 12), "sub.b": (6,), "g": ()}
    server = server_channel(latent_cfg(), {k: np.zeros(s, np.float32) for k, s in shapes.items()})
    with latent_training(call, model, names) as run:
        assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == \
            sorted(f"{o}parametrizations.{a}.0.z" for o, a in (("", "g"), ("sub.", "b"), ("", "w")))
        with torch.no_grad():  # set the latents by hand: a trained round
            for module, attr in ((model, "g"), (model.sub, "b"), (model, "w")):
                param = module.parametrizations[attr][0].z
                param.copy_(torch.from_numpy(server.split(zs[2])[{"g": "g", "b": "sub.b", "w": "w"}[attr]]))
    np.testing.assert_array_equal(run.z, zs[2])
    params = dict(model.named_parameters())  # plain parameters again, trainable as before, holding the result
    assert sorted(params) == ["g", "sub.b", "w"] and all(p.requires_grad for p in params.values())
    moved = server.expand(1, {LATENT_KEY: zs[2]})
    np.testing.assert_allclose(params["w"].detach().numpy(), STATE["w"] + moved["w"], atol=1e-6)
    np.testing.assert_allclose(params["sub.b"].detach().numpy(), moved["sub.b"], atol=1e-6)
    # the factors are regenerated, not sent: the same bits in any process (FLITE's generator)
    again = round_factors(settings_of(latent_cfg()), shapes, server.latents, 1)
    assert all(torch.equal(a, b) for k in shapes for a, b in zip(again[k], round_factors(
        settings_of(latent_cfg()), shapes, server.latents, 1)[k]))


def test_a_hostile_latent_reply_moves_the_model_at_most_the_documented_bound():
    strategy = latent_strategy(robustness=Robustness(norm_clip=0.5))
    huge = np.full(K, 1e4, np.float32)
    strategy.aggregate_train(1, [reply(1, np.zeros(K, np.float32)), reply(2, huge)])
    moved = np.sqrt(sum(np.sum(v ** 2) for v in change(strategy).values()))
    bound = strategy.channel.gain(1) * 0.5 / 2  # its clipped latents, half the mean
    assert 0 < moved <= bound * (1 + 1e-5)
    assert [b["kind"] for b in strategy.round_record()["bounded"]] == ["norm-clipped"]
    # a reply of the wrong size is refused before anything is decoded
    strategy.aggregate_train(2, [reply(1, np.zeros(K + 1, np.float32))])
    assert f"shape ({K + 1},)" in strategy.round_record()["refused"][0]["reason"]


def test_privacy_noise_is_added_to_the_latents_and_stays_in_the_rounds_subspace():
    block = {"mode": "central", "epsilon": 4.0, "delta": 1e-5, "clip": 0.5, "noise_multiplier": None, "seed": 3}
    strategy = latent_strategy(privacy=Privacy.from_config(block, rounds=5, sample_rate=1.0))
    strategy._start_round(1)
    strategy.sent["train"] = [Message(RecordDict({}), dst_node_id=v, message_type="train") for v in (1, 2)]
    strategy.aggregate_train(1, [reply(1, np.zeros(K, np.float32)), reply(2, np.zeros(K, np.float32))])
    assert strategy.round_record()["privacy"]["rounds_released"] == 1
    moved = change(strategy)
    flat = np.concatenate([moved[k].ravel() for k in strategy.channel.keys])
    basis = np.stack([np.concatenate([v.ravel() for _, v in sorted(strategy.channel.expand(1, {
        LATENT_KEY: np.eye(K, dtype=np.float32)[j]}).items())]) for j in range(K)], axis=1)
    z, *_ = np.linalg.lstsq(basis, flat, rcond=None)
    assert np.linalg.norm(flat) > 0 and np.linalg.norm(basis @ z - flat) < 1e-5 * np.linalg.norm(flat)
    # N(0, (z·clip)²) on the 20 summed latents (not on the 103 values of θ), / the 2 sampled clients
    assert np.std(z) == pytest.approx(strategy.privacy.sum_std / 2, rel=0.5)


def test_secure_aggregation_sums_latents_and_the_server_expands_the_mean():
    settings = SecureSettings(bits=16, clip=0.5)
    strategy = latent_strategy(secure=settings)
    rng = np.random.default_rng(1)
    zs = {v: {LATENT_KEY: rng.normal(0, 0.05, K)} for v in (1, 2, 3)}
    local_round(strategy, zs)
    expected = strategy.channel.expand(1, {LATENT_KEY: np.mean([z[LATENT_KEY] for z in zs.values()], axis=0)})
    for key in STATE:  # the masked sum of the latents, within the fixed-point step
        np.testing.assert_allclose(change(strategy)[key], expected[key], atol=1e-3)


# --------------------------------------------------------------------------- methods through channels, in process
@pytest.mark.parametrize("channel", ["fp32", "int4", "topk", "powersgd", "latent"])
def test_fedavg_lora_through_each_channel_averages_what_the_clients_sent(channel):
    cfg = compose(["train.local_steps=2", "channel.rank=128"] if channel == "latent" else ["train.local_steps=2"],
                  preset="test", algorithm="fedavg-lora", channel=channel)
    strategy = registry.get("fedavg-lora").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    before = {k: v.copy() for k, v in strategy.global_state.items()}
    replies = train_round(cfg, strategy, 1, {1: context(1), 2: context(2)})
    updates, weights = [], []
    for rep in replies:
        payload, examples = strategy.validate_reply(rep)
        update = strategy.client_update(payload)
        updates.append(strategy.channel.expand(1, update) if channel == "latent" else update)
        weights.append(examples)
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2 and not strategy.round_record()["refused"]
    for key in strategy.uplink_keys:
        mean = sum(w * u[key] for w, u in zip(weights, updates)) / sum(weights)
        np.testing.assert_allclose(strategy.global_state[key] - before[key], mean, atol=2e-6)
    nbytes = {codec.payload_bytes(r.content["arrays"]) for r in replies}
    values = sum(before[k].size for k in strategy.uplink_keys)
    if channel in ("fp32", "latent"):
        assert nbytes == {4 * values if channel == "fp32" else 648}
    else:
        # int4: half a byte a value + scales; top-k: 1% (8 bytes each); PowerSGD: rank 4 of 8-row LoRA factors
        assert max(nbytes) < (4 * values if channel == "powersgd" else values)


def test_fednl_learns_through_a_648_byte_latent_channel():
    cfg = compose(["channel.rank=128", "rounds=3", "algorithm.eval_local=false"], preset="test", algorithm="fednl",
                  channel="latent")
    strategy = registry.get("fednl").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    nodes = {1: context(1), 2: context(2)}

    losses = [evaluate_round(cfg, strategy, 0, nodes)["loss"]]
    gates = strategy.global_state[next(k for k in strategy.global_state if k.endswith("fednl_gate"))].copy()
    for server_round in (1, 2, 3):
        replies = train_round(cfg, strategy, server_round, nodes)
        assert [codec.payload_bytes(r.content["arrays"]) for r in replies] == [648, 648]  # 1,280 int4 latents
        strategy.aggregate_train(server_round, replies)
        losses.append(evaluate_round(cfg, strategy, server_round, nodes)["loss"])
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.03, losses
    # the meta-rules moved, the gate among them: θ is trained through the latents only
    assert not np.array_equal(gates, strategy.global_state[next(k for k in strategy.global_state
                                                                 if k.endswith("fednl_gate"))])


def test_smartfed_experts_travel_as_latents_and_every_active_expert_moves_by_the_mean(tmp_path):
    from clients.models.llm import load_causal_lm

    model, _ = load_causal_lm(compose(preset="test").model, seed=42)
    pool = fake_pool(tmp_path, model)  # one adapter: 2 layers x (q, v) x 8 experts
    cfg = compose([f"algorithm.pool={pool}", "channel.latents=256", "train.local_steps=2"],
                  preset="test", algorithm="smartfed", channel="latent")
    strategy = registry.get("smartfed").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    active = {m: sorted(int(i) for i in ids) for m, ids in strategy.allocation.active.items() if len(ids)}
    before = {m: (strategy.state.router[m][ids].copy(), strategy.state.A[m][ids].copy()) for m, ids in active.items()}
    replies = train_round(cfg, strategy, 1, {1: context(1), 2: context(2)})
    assert all(codec.payload_bytes(ArrayRecord({LATENT_KEY: r.content["arrays"][LATENT_KEY]})) == 136 for r in replies)
    assert all(set(r.content["arrays"]) - {LATENT_KEY} <= {f"{m}/importance" for m in active} for r in replies)
    strategy._start_round(1)
    parts, weights = zip(*[strategy.validate_reply(r) for r in replies])
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2 and not strategy.round_record()["refused"]
    for m, ids in active.items():  # every active expert moved, by the weighted mean of the expanded latents
        for part in parts:
            assert part[m].ids.tolist() == ids
        for field, old in zip(("router", "A"), before[m]):
            mean = sum(w * getattr(p[m], field) for p, w in zip(parts, weights)) / sum(weights)
            np.testing.assert_allclose(getattr(strategy.state, field)[m][ids] - old, mean, atol=1e-6)
            assert np.all(np.abs(mean).sum(axis=1) > 0)


# --------------------------------------------------------------------------- latent downlink
def test_a_latent_downlink_sends_the_rounds_latents_and_clients_replay_the_servers_model_bit_for_bit():
    """channel.downlink=latent: the downlink is every committed round's combined z (648 B a round in
    int4), a client rebuilds θ_fed from its own θ_fed,0 and equals the server's global state exactly;
    the history survives a checkpoint; a malformed history is refused by the client."""
    from fedapps.channel import received_state
    from strategies.channel import history_key

    cfg = compose(["train.local_steps=2", "channel.rank=128", "channel.downlink=latent"], preset="test",
                  algorithm="fedavg-lora", channel="latent")
    plan = registry.get("fedavg-lora").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg))
    strategy = plan.strategy
    assert len(strategy.downlink_arrays()) == 0  # round 1: nothing to replay, θ_fed,0 everywhere
    nodes = {1: context(1), 2: context(2)}
    initial = {k: v.copy() for k, v in strategy.global_state.items()}
    for server_round in (1, 2):
        strategy.aggregate_train(server_round, train_round(cfg, strategy, server_round, nodes))
        assert strategy.round_record()["accepted"] == 2
        down = strategy.downlink_arrays()
        assert list(down.keys()) == [history_key(t) for t in range(1, server_round + 1)]
        assert codec.payload_bytes(down) == 648 * server_round
        replayed = received_state(cfg, down, {k: initial[k] for k in strategy.uplink_keys})
        for key in strategy.uplink_keys:
            np.testing.assert_array_equal(replayed[key], strategy.global_state[key])
        assert any(not np.array_equal(replayed[k], initial[k]) for k in strategy.uplink_keys)
    # a fresh process's full replay (no cached prefix) gives the same bits
    import fedapps.channel as channel_module

    channel_module._REPLAYED.clear()
    again = received_state(cfg, strategy.downlink_arrays(), {k: initial[k] for k in strategy.uplink_keys})
    for key in strategy.uplink_keys:
        np.testing.assert_array_equal(again[key], strategy.global_state[key])
    # a resumed server sends the same bytes
    arrays, meta = strategy.state_dict()
    resumed = registry.get("fedavg-lora").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    resumed.load_state_dict(arrays, meta)
    assert [(k, a.data) for k, a in resumed.downlink_arrays().items()] == \
        [(k, a.data) for k, a in strategy.downlink_arrays().items()]
    # a client refuses a history it cannot replay
    bad = ArrayRecord()
    bad["latent/round-x"] = strategy.downlink_arrays()[history_key(1)]
    with pytest.raises(codec.PayloadError, match="not a round of a latent downlink"):
        received_state(cfg, bad, initial)
    short = ArrayRecord()
    short[history_key(1)] = codec.encode({"z": np.zeros(7, np.float32)}, "int4")["z"]
    with pytest.raises(codec.PayloadError, match="a round of 7 latents"):
        received_state(cfg, short, {k: initial[k] for k in strategy.uplink_keys})


def test_a_latent_downlink_is_refused_for_methods_whose_clients_do_not_replay_it():
    with pytest.raises(ConfigError, match="channel.downlink=latent: algorithm 'fednl'"):
        compose(["channel.downlink=latent"], preset="test", algorithm="fednl", channel="latent")
    with pytest.raises(ConfigError, match="channel.downlink must be dense or latent"):
        compose(["channel.downlink=sparse"], preset="test", algorithm="fedavg-lora", channel="latent")


def test_fedavg_lora_learns_with_latents_both_ways():
    """channel.downlink=latent: 648 B up, r × 648 B down, and the held-out loss falls every round (the
    evaluating clients replay the history, as the training ones do)."""
    cfg = compose(["channel.rank=128", "channel.downlink=latent", "train.lr=3e-3", "train.local_steps=4"],
                  preset="test", algorithm="fedavg-lora", channel="latent")
    strategy = registry.get("fedavg-lora").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    nodes = {1: context(1), 2: context(2)}

    losses = [evaluate_round(cfg, strategy, 0, nodes)["loss"]]
    for server_round in (1, 2, 3):
        assert codec.payload_bytes(strategy.downlink_arrays()) == 648 * (server_round - 1)
        replies = train_round(cfg, strategy, server_round, nodes)
        assert [codec.payload_bytes(r.content["arrays"]) for r in replies] == [648, 648]
        strategy.aggregate_train(server_round, replies)
        losses.append(evaluate_round(cfg, strategy, server_round, nodes)["loss"])
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.03, losses


def test_a_latent_downlink_in_fp32_moves_the_model_exactly_as_the_dense_downlink():
    """Its rows are the combined z itself: the same θ_fed as the dense downlink, bit for bit, at
    5,120 B a round for 1,280 latents instead of θ_fed; in int4 the rows are rounded (648 B)."""
    rng = np.random.default_rng(0)
    z = [rng.standard_normal(K).astype(np.float32) for _ in range(3)]
    states, sizes = {}, {}
    for name, block in {"dense": {}, "fp32": {"downlink": "latent", "downlink_format": "fp32"},
                        "int4": {"downlink": "latent", "downlink_format": "int4"}}.items():
        strategy = PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=3, uplink="delta",
                                 channel=server_channel(latent_cfg(**block), STATE))
        for server_round in (1, 2):
            strategy.aggregate_train(server_round, [reply(n + 1, z[n] * server_round) for n in range(3)])
        states[name], sizes[name] = strategy.global_state, codec.payload_bytes(strategy.downlink_arrays())
    for key in STATE:
        np.testing.assert_array_equal(states["fp32"][key], states["dense"][key])
    assert sizes == {"dense": 4 * (96 + 6 + 1), "fp32": 2 * 4 * K, "int4": 2 * ((K + 1) // 2 + 8)}
    assert any(not np.array_equal(states["int4"][k], states["dense"][k]) for k in STATE)
    with pytest.raises(ConfigError, match="channel.downlink_format must be"):
        compose(["channel.downlink=latent", "channel.downlink_format=int8"], preset="test", algorithm="fedavg-lora",
                channel="latent")


def half_sampled_latent_run(folder, rounds: int) -> dict:
    """fedavg-lora on the tiny model through the latent channel both ways, 4 clients, half sampled a round
    (the same draw every call)."""
    import random

    from inprocess import run

    random.seed(0)
    cfg = compose(["num_clients=4", f"rounds={rounds}", "strategy.fraction_train=0.5",
                   "strategy.fraction_evaluate=0.5", "train.local_steps=2", "channel.rank=128",
                   "channel.downlink=latent", f"output_dir={folder}"],
                  preset="test", algorithm="fedavg-lora", channel="latent")
    return run(cfg)


def test_a_latent_downlink_sends_each_client_only_the_rounds_it_missed(tmp_path, monkeypatch):
    """#63: with channel.downlink=latent every message carried the whole history (r × 648 B after r rounds).
    Now a client is sent the rounds after the last one it confirmed (by answering), keeps them in its node's
    state, and replays the same model: 4 clients, half sampled a round, the run's metrics bit-identical to
    the whole-history run's, and each message's downlink at most (rounds it missed + 1) × 648 B."""
    from strategies.channel import LatentSync

    def one(folder):
        return half_sampled_latent_run(folder, rounds=4)

    missed = one(tmp_path / "missed")
    records = [__import__("json").loads(line) for line in
               open(f"{missed['run_dir']}/metrics.jsonl").read().splitlines()]
    answered: dict[int, int] = {}  # node -> the last round whose message it answered (it holds rounds < that)
    for record in records[1:]:
        r = record["round"]
        for client in record["clients"]:
            node = client["node_id"]
            if "train_downlink_payload_bytes" in client:
                held = answered.get(node, 1) - 1
                assert client["train_downlink_payload_bytes"] <= (r - 1 - held) * 648 + 1, (node, r, held)
        for client in record["clients"]:
            answered[client["node_id"]] = r
    assert sum(c.get("train_downlink_payload_bytes", 0) for rec in records for c in rec["clients"]) > 0
    monkeypatch.setattr(LatentSync, "since", lambda self, node: 0)  # the whole history to everyone, as before
    whole = one(tmp_path / "whole")
    assert missed["metric_by_round"] == whole["metric_by_round"]
    assert missed["uplink_bytes_per_client_round"] == whole["uplink_bytes_per_client_round"] == 648

    def downlink(summary):
        lines = open(f"{summary['run_dir']}/metrics.jsonl").read().splitlines()
        return sum(c.get(f"{p}_downlink_payload_bytes", 0) for line in lines
                   for c in __import__("json").loads(line)["clients"] for p in ("train", "eval"))

    assert downlink(missed) < downlink(whole)


def test_a_client_that_missed_more_than_a_snapshot_is_sent_the_tensors_and_replays_on_from_them(tmp_path,
                                                                                                 monkeypatch):
    """#63: a client that missed many rounds (or joins late) is sent the federated tensors themselves when they
    are fewer bytes than the rounds it missed, keeps them, and replays later rounds from them: the run's
    metrics are bit-identical to the whole-history run's (snapshots forced here whenever a round was missed)."""
    import json

    from strategies.channel import LatentSync

    def one(folder):
        return half_sampled_latent_run(folder, rounds=5)

    monkeypatch.setattr(LatentSync, "snapshot_below", 1e12)  # a snapshot whenever any round was missed
    snapshots = one(tmp_path / "snapshots")
    records = [json.loads(line) for line in open(f"{snapshots['run_dir']}/metrics.jsonl").read().splitlines()]
    sizes = {c.get(f"{p}_downlink_payload_bytes") for r in records for c in r["clients"] for p in ("train", "eval")}
    assert max(s for s in sizes if s) > 10 * 648  # some messages carried the dense tensors
    monkeypatch.setattr(LatentSync, "snapshot_below", 0.0)
    monkeypatch.setattr(LatentSync, "since", lambda self, node: 0)  # the whole history to everyone, as before
    whole = one(tmp_path / "whole")
    assert snapshots["metric_by_round"] == whole["metric_by_round"]
    assert [r.get("train_loss") for r in records] == [
        json.loads(line).get("train_loss") for line in open(f"{whole['run_dir']}/metrics.jsonl").read().splitlines()]


def test_the_flite_per_round_preset_sends_648_bytes_both_ways_and_trains_every_tensor(tmp_path):
    """#64: FLITE's mechanism with a fresh subspace each round, by name (conf/preset/flite-per-round.yaml):
    full FedAvg's tensors (the head included) through the latent channel, 648 int4 bytes up, the missed
    rounds' latents down."""
    from inprocess import run

    cfg = compose(["model=tiny-llama", "num_clients=2", "rounds=2", "train.local_steps=2", "train.batch_size=2",
                   "train.seq_len=32", "channel.rank=128", "eval.max_batches=1", f"output_dir={tmp_path}"],
                  preset="flite-per-round")
    assert (cfg.algorithm.name, cfg.channel.name, cfg.channel.downlink) == ("fedavg-full", "latent", "latent")
    summary = run(cfg)
    assert summary["status"] == "completed" and summary["uplink_bytes_per_client_round"] == 648
    lines = open(f"{summary['run_dir']}/metrics.jsonl").read().splitlines()
    down: dict = {}
    for line in lines:
        for c in __import__("json").loads(line)["clients"]:
            for phase in ("train", "eval"):
                down.setdefault(c["node_id"], []).append(c.get(f"{phase}_downlink_payload_bytes", 0))
    # each client is sent each committed round's latents once (with the evaluation that follows it): 2 × 648
    assert sorted(sum(v) for v in down.values()) == [2 * 648, 2 * 648], down


def test_a_rounds_dependent_draw_is_drawn_again_the_same_way_everywhere(monkeypatch):
    """#63: at 1,000 clients a 32-value bias given 32 latents drew dependent directions in round 45 and every
    client failed: the draw is repeated under a derived name, identically on the server and the clients."""
    from clients import factors as factor_module
    from fedapps import channel as fchannel

    settings = fchannel.LatentSettings(latents=8, rank=64, seed=5, scale=1.0, split="sqrt")
    shapes = {"w": (4, 6), "b": (8,)}
    latents = fchannel.allocate(shapes, settings)
    real, names = factor_module.build_factors, []

    def flaky(seed, spec, params, scale, mode):
        names.append(spec.name)
        if spec.name == "channel/round-3/b":
            raise ValueError("dependent directions")
        return real(seed, spec, params, scale, mode)

    monkeypatch.setattr(factor_module, "build_factors", flaky)
    first = fchannel.round_factors(settings, shapes, latents, 3)
    again = fchannel.round_factors(settings, shapes, latents, 3)
    assert "channel/round-3/b/redraw-1" in names
    assert all(torch.equal(a, b) for key in first for a, b in zip(first[key], again[key]))
