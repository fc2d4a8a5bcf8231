"""train.grad_checkpointing: the same training, recomputed activations.

Gradient checkpointing may only change memory and time: one local training step with it
must give the same trainable values (and, for SmartFed, the same importance statistic,
although the checkpointed layers run their forward twice) as without it.
"""

import copy

import numpy as np
import pytest
import torch

from clients.tasks import make_task
from clients.train import TrainingError, local_train
from fedapps.config import compose

TINY = ["train.local_steps=2", "train.batch_size=2", "train.seq_len=16", "train.lr=1e-2"]


def _train_twice(model, task, cfg):
    """The trainable values after training without and with checkpointing (same start)."""
    results = []
    for flag in (False, True):
        copy_ = copy.deepcopy(model)
        calls = []
        first = next(m for m in copy_.modules() if type(m).__name__.endswith("DecoderLayer"))
        first.self_attn.register_forward_hook(lambda *_: calls.append(1))  # inside the checkpoint
        train_cfg = cfg.train.copy()
        train_cfg.grad_checkpointing = flag
        metrics = local_train(copy_, task, train_cfg, seed=0)
        # checkpointed: each step's forward runs again in backward
        assert len(calls) == train_cfg.local_steps * (2 if flag else 1)
        assert not first.training  # the model is back in eval mode
        values = {n: p.detach().clone() for n, p in copy_.named_parameters() if p.requires_grad}
        results.append((copy_, values, metrics))
    return results


def _assert_same(results):
    (_, plain, m0), (_, ckpt, m1) = results
    assert plain.keys() == ckpt.keys() and plain
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-5)


@pytest.mark.parametrize("algorithm", ["fedavg-lora", "fednl"])
def test_checkpointing_trains_the_same_values(algorithm):
    from fedapps import baselines, fednl

    cfg = compose(TINY, algorithm=algorithm, preset="test")
    prepare = fednl.prepare if algorithm == "fednl" else baselines.prepare
    model, tokenizer, _ = prepare(cfg)
    task = make_task(cfg, 0, int(cfg.num_clients), tokenizer)
    _assert_same(_train_twice(model, task, cfg))


def test_checkpointing_keeps_smartfed_values_and_importance():
    from clients.smartfed.more import MoREConfig, importance_state, load_mixture
    from fedapps.smartfed import prepare

    cfg = compose(TINY, algorithm="smartfed", preset="test")
    model, tokenizer, _ = prepare(cfg)
    rng = np.random.default_rng(0)
    downlink = {}
    for layer in range(2):
        m = f"model.layers.{layer}.mlp.down_proj"
        d_in, d_out = model.get_submodule(m).in_features, model.get_submodule(m).out_features
        downlink |= {f"{m}/ids": np.array([0, 1, 2], np.float32),
                     f"{m}/router": rng.normal(scale=0.5, size=(3, d_in)).astype(np.float32),
                     f"{m}/A": rng.normal(scale=0.1, size=(3, d_in)).astype(np.float32),
                     f"{m}/B": rng.normal(scale=0.1, size=(3, d_out)).astype(np.float32)}
    load_mixture(model, downlink, MoREConfig(top_k=2))
    task = make_task(cfg, 0, int(cfg.num_clients), tokenizer)
    results = _train_twice(model, task, cfg)
    _assert_same(results)
    plain, ckpt = importance_state(results[0][0]), importance_state(results[1][0])
    assert plain.keys() == ckpt.keys() and plain
    for key in plain:  # counted once per step, not once more for the replay in backward
        np.testing.assert_allclose(ckpt[key], plain[key], rtol=1e-5)


def test_checkpointing_a_model_without_decoder_layers_is_refused():
    from fedapps import baselines

    cfg = compose(["train.local_steps=1", "train.grad_checkpointing=true"], algorithm="fedavg-full",
                  task="fmnist", model="tiny-cnn", preset="test")
    model, _, _ = baselines.prepare(cfg)
    task = make_task(cfg, 0, int(cfg.num_clients), None)
    with pytest.raises(TrainingError, match="train.grad_checkpointing needs a transformers causal LM"):
        local_train(model, task, cfg.train, seed=0)


def test_a_non_boolean_setting_is_refused_at_compose_time():
    from fedapps.config import ConfigError

    with pytest.raises(ConfigError, match="train.grad_checkpointing must be true or false, got 'maybe'"):
        compose(["train.grad_checkpointing=maybe"], preset="test")
