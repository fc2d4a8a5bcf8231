"""train.frozen_bf16: the frozen backbone in bfloat16 on CPU, what trains in fp32, every causal-LM method."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from inprocess import context, evaluate_round, pool_overrides, train_round

from fedapps import registry
from fedapps.config import compose, to_yaml
from fedapps.session import _MODELS


def client_model():
    """The model this process's client session holds (fedapps.session keeps one)."""
    (model, _, _, _), = _MODELS.values()
    return model


@pytest.mark.parametrize("algorithm", ["fedavg-lora", "fednl", "flite", "smartfed"])
def test_the_frozen_backbone_is_bf16_what_trains_is_fp32_and_the_round_learns(algorithm, tmp_path):
    # small (bf16 matmuls are emulated on most CPUs: the 49,152-token LM head dominates): 2 steps of 2 x 32 tokens
    # (FedNL 4: with one memory per key/value head its loss moves by noise in 2), one evaluation batch of 4
    steps = 4 if algorithm == "fednl" else 2
    overrides = ["train.frozen_bf16=true", f"train.local_steps={steps}", "train.batch_size=2", "train.lr=3e-3",
                 "eval.batch_size=4", "eval.max_batches=1"]
    overrides += pool_overrides(algorithm, tmp_path)
    cfg = compose(overrides, algorithm=algorithm, preset="test")
    strategy = registry.get(algorithm).plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    nodes = {1: context(1), 2: context(2)}
    before = evaluate_round(cfg, strategy, 0, nodes)["loss"]
    replies = train_round(cfg, strategy, 1, nodes)
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2, strategy.round_record()["refused"]
    after = evaluate_round(cfg, strategy, 1, nodes)["loss"]
    assert math.isfinite(after) and after < before, (before, after)
    model = client_model()
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16  # the backbone: half the bytes
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for _, p in trained)  # adapters, latents, experts, memory


def test_frozen_bf16_scores_close_to_fp32():
    """The same round-0 model in bf16 storage + autocast and in fp32: held-out loss within 1%."""
    losses = {}
    for flag in ("false", "true"):
        cfg = compose([f"train.frozen_bf16={flag}"], algorithm="fedavg-lora", preset="test")
        strategy = registry.get("fedavg-lora").plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
        losses[flag] = evaluate_round(cfg, strategy, 0, {1: context(1), 2: context(2)})["loss"]
        dtype = client_model().get_input_embeddings().weight.dtype
        assert dtype == (torch.bfloat16 if flag == "true" else torch.float32)
    assert losses["true"] != losses["false"]
    np.testing.assert_allclose(losses["true"], losses["false"], rtol=0.01)
