"""Local training and evaluation of whatever a method left trainable."""

from __future__ import annotations

import math
import time

import numpy as np
import torch


class TrainingError(RuntimeError):
    pass


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainingError("the model has no trainable parameter; check the algorithm's configuration")
    return params


def local_train(
    model,
    task,
    train_cfg,
    *,
    seed: int,
    proximal_mu: float = 0.0,
    reference: dict[str, torch.Tensor] | None = None,
) -> dict[str, float | int]:
    """Run ``train_cfg.local_steps`` AdamW steps on the client's training split.

    The model stays in eval mode (no dropout; BatchNorm keeps its pretrained statistics),
    so a round is a deterministic function of (global state, data, seed). With
    ``proximal_mu > 0`` the FedProx term (mu/2)·||w − w_ref||² is added over the
    ``reference`` tensors (the global values received this round).
    """
    torch.set_num_threads(max(1, int(train_cfg.get("threads", 1))))
    params = trainable_parameters(model)
    named = dict(model.named_parameters())
    if proximal_mu > 0:
        if not reference:
            raise TrainingError("FedProx needs the global reference tensors")
        prox_pairs = [(named[k], v.to(named[k].device)) for k, v in reference.items()]
    optimizer = torch.optim.AdamW(params, lr=float(train_cfg.lr), weight_decay=float(train_cfg.get("weight_decay", 0.0)))
    rng = np.random.default_rng(seed)
    losses = []
    start = time.perf_counter()
    model.eval()
    for batch in task.train_batches(int(train_cfg.local_steps), int(train_cfg.batch_size), rng):
        loss = task.loss(model, batch)
        if not torch.isfinite(loss):
            raise TrainingError(f"the training loss became {loss.item()}; lower train.lr (now {train_cfg.lr})")
        losses.append(loss.item())
        if proximal_mu > 0:
            loss = loss + 0.5 * proximal_mu * sum(((p - r) ** 2).sum() for p, r in prox_pairs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = float(train_cfg.get("max_grad_norm", 0.0) or 0.0)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": float(np.mean(losses)),
        "first-loss": float(losses[0]),
        "last-loss": float(losses[-1]),
        "seconds": time.perf_counter() - start,
        "num-examples": int(task.num_train),
    }


def evaluate(model, task, eval_cfg) -> dict[str, float | int]:
    start = time.perf_counter()
    model.eval()
    with torch.no_grad():
        metrics = task.evaluate(model, int(eval_cfg.batch_size), int(eval_cfg.max_batches))
    if not all(math.isfinite(float(v)) for v in metrics.values()):
        raise TrainingError(f"evaluation produced non-finite metrics: {metrics}")
    metrics["seconds"] = time.perf_counter() - start
    return metrics
