"""FedALA (adaptive local aggregation) and FedSSI (synaptic-intelligence regularisation)."""


import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from omegaconf import OmegaConf

from clients.adapters import federated_state, load_federated_state
from clients.tasks import make_task
from clients import fedala as ala_method
from clients import fedssi as ssi_method
from fedapps import fedala, fedssi
from inprocess import answer
from fedapps.baselines import prepare
from fedapps.config import compose, to_yaml
from fedapps.outputs import mean_train_loss, read_metrics
from strategies import codec
from strategies.screening import CONFIG_RECORD
from strategies.fedssi import FedSSI

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lora_setup():
    cfg = compose(["train.local_steps=3", "algorithm.eval_local=false"], preset="test", algorithm="fedala")
    model, tokenizer, extra = prepare(cfg)
    task = make_task(cfg, 0, 2, tokenizer)
    names = ala_method.model_order(model, extra["names"])
    return cfg, model, task, names


def perturbed(state, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    return {n: v + scale * torch.randn(v.shape, generator=generator) for n, v in state.items()}


def context(node_id=1, partition_id=0):
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": partition_id, "num-partitions": 2},
                   state=RecordDict(), run_config={})


def message(cfg, arrays, phase, server_round, node_id=1, **config):
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round, **config}),
                          CONFIG_RECORD: ConfigRecord({"yaml": to_yaml(cfg)})})
    return Message(content, dst_node_id=node_id, message_type=phase)


# --------------------------------------------------------------------------- FedALA
def test_ala_takes_global_lower_layers_and_mixes_the_top_elementwise(lora_setup):
    cfg, model, task, names = lora_setup
    base = federated_state(model, names)
    global_state, local_state = perturbed(base, 0.05, 1), perturbed(base, 0.05, 2)
    ala = OmegaConf.merge(cfg.algorithm.ala, {"layer_idx": 4, "eta": 50.0, "max_batches": 2})
    result = ala_method.adaptive_local_aggregation(
        model, task, names, global_state, local_state, None, ala, batch_size=4,
        rng=np.random.default_rng(0), start_phase=False,
    )
    lower, top = names[:-4], names[-4:]
    assert top == names[-4:] and all(".layers.1." in n for n in top)  # the top decoder layer, model order
    assert all(torch.equal(result.state[n], global_state[n]) for n in lower)
    assert len(result.losses) == 1 and set(result.weights) == set(top)
    moved = False
    for n in top:
        w = result.weights[n]
        assert ((w >= 0) & (w <= 1)).all()
        expected = local_state[n] + (global_state[n] - local_state[n]) * w
        assert torch.allclose(result.state[n], expected, atol=1e-6)
        moved |= bool((w < 1).any())
    assert moved  # the weights learned something
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n].detach(), result.state[n]) for n in names)  # left in the model
    assert all(params[n].requires_grad for n in names)  # gradient flags restored


def test_ala_start_phase_stops_at_threshold_or_cap(lora_setup):
    cfg, model, task, names = lora_setup
    base = federated_state(model, names)
    g, l = perturbed(base, 0.05, 3), perturbed(base, 0.05, 4)
    kwargs = dict(batch_size=4, rng=np.random.default_rng(1), start_phase=True)
    loose = OmegaConf.merge(cfg.algorithm.ala, {"threshold": 1e9, "num_pre_loss": 2, "max_batches": 1})
    result = ala_method.adaptive_local_aggregation(model, task, names, g, l, None, loose, **kwargs)
    assert result.converged and len(result.losses) == 3  # more than num_pre_loss passes, then the std test
    capped = OmegaConf.merge(cfg.algorithm.ala, {"threshold": 0.0, "max_start_epochs": 2, "max_batches": 1})
    result = ala_method.adaptive_local_aggregation(model, task, names, g, l, None, capped, **kwargs)
    assert not result.converged and len(result.losses) == 2
    with pytest.raises(ala_method.ALAError, match="layer_idx"):
        bad = OmegaConf.merge(cfg.algorithm.ala, {"layer_idx": 0})
        ala_method.adaptive_local_aggregation(model, task, names, g, l, None, bad, **kwargs)


def test_fedala_client_keeps_its_adapter_and_runs_ala_once_per_global(lora_setup):
    cfg = compose(["train.local_steps=2", "algorithm.ala.max_batches=1", "algorithm.ala.max_start_epochs=2",
                   "algorithm.eval_local=false"], preset="test", algorithm="fedala")
    plan = fedala.plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg))
    node = context()
    first = plan.strategy.downlink_arrays()
    out = answer(message(cfg, first, "evaluate", 0), node)  # first contact: no ALA
    assert out.content["metrics"]["ala-passes"] == 0
    assert {fedala.LOCAL, fedala.STATUS} <= set(node.state.keys())
    out = answer(message(cfg, first, "train", 1), node)  # same global: not absorbed twice
    assert "ala-passes" not in out.content["metrics"]
    trained = codec.decode(out.content["arrays"])
    assert sorted(trained) == sorted(plan.strategy.uplink_keys)
    stored = codec.decode(node.state.array_records[fedala.LOCAL])
    assert all(np.array_equal(stored[k], trained[k]) for k in trained)  # the node keeps what it trained

    second = codec.encode({k: v + 0.01 for k, v in trained.items()})  # a new global adapter
    out = answer(message(cfg, second, "evaluate", 1), node)
    assert out.content["metrics"]["ala-passes"] == 2  # the start phase, capped
    assert fedala.WEIGHTS in node.state.array_records
    weights = np.concatenate([w.ravel() for w in codec.decode(node.state.array_records[fedala.WEIGHTS]).values()])
    got = out.content["metrics"]  # how far the weights moved, as bench/fedala_eta.py reports it
    assert (got["ala-weight-min"], got["ala-weight-max"]) == (float(weights.min()), float(weights.max()))
    assert got["ala-weight-min"] <= got["ala-weight-mean"] <= got["ala-weight-max"] <= 1.0
    out = answer(message(cfg, second, "train", 2), node)
    assert "ala-passes" not in out.content["metrics"]  # already absorbed at the evaluation
    third = codec.encode({k: v + 0.02 for k, v in trained.items()})
    out = answer(message(cfg, third, "train", 3), node)  # not evaluated: ALA at training
    assert out.content["metrics"]["ala-passes"] == 1  # after the start phase, one pass


# --------------------------------------------------------------------------- FedSSI
def test_si_importance_is_the_damped_path_integral():
    path = {"w": torch.tensor([0.2, -0.1, 0.0])}
    end, start = {"w": torch.tensor([1.0, 1.0, 2.0])}, {"w": torch.tensor([0.0, 0.5, 2.0])}
    omega = ssi_method.si_importance(path, end, start, xi=0.1)["w"]
    assert torch.allclose(omega, torch.tensor([0.2 / 1.1, 0.0, 0.0]))


def test_surrogate_accumulates_a_path_and_returns_the_model_to_the_global(lora_setup):
    cfg, model, task, names = lora_setup
    reference = perturbed(federated_state(model, names), 0.01, 5)
    load_federated_state(model, reference)
    path, end, loss = ssi_method.surrogate_path(model, task, names, reference, cfg.train, steps=3, lam=0.5, seed=0)
    assert np.isfinite(loss)
    assert any(not torch.equal(end[n], reference[n]) for n in names)  # the PSM moved
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n].detach(), reference[n]) for n in names)  # and was discarded
    omega = ssi_method.si_importance(path, end, reference, xi=1e-3)
    total = sum(v.sum() for v in omega.values())
    assert total > 0 and all((v >= 0).all() for v in omega.values())


def test_importance_penalty_holds_important_parameters_near_the_global(lora_setup):
    cfg, model, task, names = lora_setup
    reference = federated_state(model, names)

    def distance(c):
        load_federated_state(model, reference)
        omega = {n: torch.full_like(v, 100.0) for n, v in reference.items()}
        metrics, path = ssi_method.si_local_train(model, task, cfg.train, seed=0, names=names, reference=reference,
                                              omega=omega, c=c, track=True)
        assert metrics["num-examples"] == task.num_train and path is not None
        params = dict(model.named_parameters())
        return sum(float(((params[n].detach() - reference[n]) ** 2).sum()) for n in names), metrics

    free, free_metrics = distance(0.0)
    held, held_metrics = distance(10.0)
    assert free_metrics["si-penalty"] == 0.0 and held_metrics["si-penalty"] > 0
    assert held < free
    load_federated_state(model, reference)


def test_fedssi_strategy_sends_its_regularisation_and_refuses_bad_values():
    state = {"a.lora_A.w": np.zeros((2, 2), np.float32), "a.lora_B.w": np.zeros((2, 2), np.float32)}
    strategy = FedSSI(c=0.5, lam=0.3, initial_state=state, config_yaml="", num_clients=1)
    config = strategy.train_config_for(1, 7, ConfigRecord({}))
    assert config["ssi-c"] == 0.5 and config["ssi-lambda"] == 0.3
    with pytest.raises(ValueError, match="c must be"):
        FedSSI(c=-1, lam=0.3, initial_state=state, config_yaml="", num_clients=1)
    with pytest.raises(ValueError, match="lam"):
        FedSSI(c=1, lam=0.0, initial_state=state, config_yaml="", num_clients=1)


def test_fedssi_client_keeps_its_importance_on_the_node():
    cfg = compose(["train.local_steps=2", "algorithm.ssi.psm_steps=2", "algorithm.eval_local=false"],
                  preset="test", algorithm="fedssi")
    plan = fedssi.plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg))
    node = context()
    msg = message(cfg, plan.strategy.downlink_arrays(), "train", 1,
                  **dict(plan.strategy.train_config_for(1, 1, ConfigRecord({}))))
    out = answer(msg, node)
    metrics = out.content["metrics"]
    assert metrics["omega-mean"] > 0 and metrics["si-penalty"] >= 0 and "psm-loss" in metrics
    assert sorted(codec.decode(out.content["arrays"])) == sorted(plan.strategy.uplink_keys)  # Ω is not sent
    omega = codec.decode(node.state.array_records[fedssi.OMEGA])
    assert sorted(omega) == sorted(plan.strategy.uplink_keys)
    out = answer(msg, node)  # round 2: Ω accumulates
    assert out.content["metrics"]["omega-mean"] > metrics["omega-mean"]


# --------------------------------------------------------------------------- simulations
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedala", "fedssi"])
def test_baseline_learns_over_three_rounds(algorithm, outputs):
    from inprocess import run as simulate  # run_server in this process (#40: no Ray start)

    cfg = compose(["algorithm.ala.max_start_epochs=3"] if algorithm == "fedala" else [], preset="test",
                  algorithm=algorithm)
    summary = simulate(cfg)
    rounds = read_metrics(summary["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and summary["refused_replies"] == 0
    assert mean_train_loss(rounds[3]) < mean_train_loss(rounds[1])
    assert rounds[3]["eval"]["perplexity"] < rounds[0]["eval"]["perplexity"]
    assert len({c["uplink_payload_bytes"] for r in rounds[1:] for c in r["clients"]}) == 1
    assert all("train_local-perplexity" in c for r in rounds[1:] for c in r["clients"])
    if algorithm == "fedala":
        assert all(c["eval_ala-passes"] >= 1 for r in rounds[1:] for c in r["clients"])
    else:
        assert all(c["train_omega-mean"] > 0 and c["train_si-penalty"] > 0 for r in rounds[1:] for c in r["clients"])
