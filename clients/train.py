"""Local training and evaluation of whatever a method left trainable.

Device placement (used by ``fedapps.session`` once per client process):
:func:`select_device` picks CUDA when present (or what ``train.device`` / a node's
``device`` asks for), :func:`place_model` moves the model there once and, on CUDA with
``bf16``, marks it for bfloat16 autocast; :func:`place_task` makes the task's batches
land on the same device. :func:`local_train` and :func:`evaluate` run their forward
passes under that autocast. On CPU nothing is moved or marked, so CPU runs are exactly
what they were, unless ``train.frozen_bf16`` stores the frozen backbone in bfloat16.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from contextvars import ContextVar
from logging import INFO

import numpy as np
import torch
from flwr.common.logger import log

# who is training, for the progress lines (" (client 2, node 1234...)"; the ClientApp sets it per message)
PROGRESS_LABEL: ContextVar[str] = ContextVar("postcard_progress_label", default="")


@contextlib.contextmanager
def progress_label(label: str):
    """Progress lines of the training inside the block carry ``label`` (e.g. which client it is)."""
    token = PROGRESS_LABEL.set(label)
    try:
        yield
    finally:
        PROGRESS_LABEL.reset(token)
AUTOCAST_ATTR = "_postcard_autocast_dtype"  # set by place_model (CUDA with bf16, or frozen_bf16)


class TrainingError(RuntimeError):
    pass


# ---------------------------------------------------------------------------- devices
def select_device(preference: str | None = "auto") -> torch.device:
    """``auto`` (or empty): CUDA when available, else CPU; otherwise the named device, checked."""
    choice = str(preference or "auto").strip().lower()
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise TrainingError(f"unknown device '{preference}'; use auto, cpu, cuda or cuda:<index>") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainingError(f"device '{preference}' was asked for but this process sees no CUDA device "
                                "(check the driver, CUDA_VISIBLE_DEVICES, or use device=auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise TrainingError(f"device '{preference}' does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type != "cpu":
        raise TrainingError(f"device type '{device.type}' is not supported; use auto, cpu, cuda or cuda:<index>")
    return device


def model_device(model) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def place_model(model, device: torch.device, *, bf16: bool = True, frozen_bf16: bool = False):
    """Move ``model`` to ``device`` once; on CUDA with ``bf16`` (and hardware support), mark
    it so that :func:`local_train` / :func:`evaluate` autocast its forward passes to bfloat16.
    Weights, optimiser state and payloads stay float32.

    ``frozen_bf16`` (CPU or CUDA): every parameter that does not train (the backbone) is
    stored in bfloat16 — about half the model's memory — and the forward passes run under
    bfloat16 autocast; what trains (adapters, latents, experts, FedNL's memory) stays fp32.
    Without it a CPU model is untouched (bit-identical to the unplaced model)."""
    if frozen_bf16:
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(torch.bfloat16)
    if device.type == "cpu":
        if frozen_bf16:
            setattr(model, AUTOCAST_ATTR, torch.bfloat16)
        return model
    model = model.to(device)
    use_bf16 = (bool(bf16) or frozen_bf16) and device.type == "cuda" and torch.cuda.is_bf16_supported()
    setattr(model, AUTOCAST_ATTR, torch.bfloat16 if use_bf16 else None)
    return model


def _to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def place_task(task, device: torch.device):
    """Make every batch the task builds (``collate``) land on ``device``; CPU: untouched."""
    if device.type == "cpu" or getattr(task, "_postcard_device", None) == device:
        return task
    collate = task.collate

    def collate_on_device(indices):
        return _to_device(collate(indices), device)

    task.collate = collate_on_device
    task._postcard_device = device
    return task


def autocast(model):
    """bfloat16 autocast for a model :func:`place_model` marked; a no-op context otherwise."""
    dtype = getattr(model, AUTOCAST_ATTR, None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model_device(model).type, dtype=dtype)


@contextlib.contextmanager
def grad_checkpointing(model, enabled: bool):
    """Within the block, each decoder layer keeps only its input for the backward pass and
    recomputes the rest there (HF gradient checkpointing, non-reentrant): activation memory
    falls from every layer's intermediates to one layer's, for about one more forward pass.

    HF checkpoints a layer only when that layer is in training mode; the model stays in
    eval mode (no dropout), so just the layer objects themselves are flagged, not their
    children, and gradients equal those without checkpointing.
    """
    if not enabled:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers or not hasattr(model, "activation_checkpointing_enable"):
        raise TrainingError(f"train.grad_checkpointing needs a transformers causal LM; {type(model).__name__} "
                            "has no checkpointable layers (set train.grad_checkpointing=false)")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    flags = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True  # the layer object only: its submodules stay in eval mode
    try:
        yield
    finally:
        model.activation_checkpointing_disable()
        for layer, flag in zip(layers, flags):
            layer.training = flag


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainingError("the model has no trainable parameter; check the algorithm's configuration")
    return params


def parameter_groups(model, lr: float, lr_by_name: Mapping[str, float] | None = None) -> list[dict]:
    """The optimiser's parameter groups: a trainable parameter whose name contains a key of
    ``lr_by_name`` (the first such key, in its order) trains at that learning rate, the rest at ``lr``."""
    trainable_parameters(model)  # at least one
    patterns = list((lr_by_name or {}).items())
    groups: dict[float, list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            rate = next((float(r) for pattern, r in patterns if pattern in name), float(lr))
            groups.setdefault(rate, []).append(param)
    return [{"params": params, "lr": rate} for rate, params in groups.items()]


class TrainHooks:
    """What a method adds to :func:`local_train`'s loop, so that every method trains in the one
    loop (and gets its memory options): an objective ``data_weight · loss + penalty()`` and
    observers around each optimiser step. FedProx's proximal term (:class:`Proximal`) and
    FedSSI's synaptic intelligence (``clients.fedssi``) are hooks."""

    data_weight: float = 1.0

    def penalty(self) -> torch.Tensor | float:
        """A term added to the step's loss (0: none)."""
        return 0.0

    def after_backward(self) -> None:
        """Called with the step's gradients in place, before clipping and the optimiser step."""

    def after_step(self) -> None:
        """Called after the optimiser step."""

    def metrics(self) -> dict[str, float]:
        """Metrics of the method's own terms, added to the training metrics."""
        return {}


class Proximal(TrainHooks):
    """FedProx (Li et al., 2020): ``(mu/2)·||w − w_ref||²`` over the ``reference`` tensors."""

    def __init__(self, model, mu: float, reference: dict[str, torch.Tensor]) -> None:
        if not reference:
            raise TrainingError("FedProx needs the global reference tensors")
        self.mu = float(mu)
        # (module, attribute) read at every step: a parametrized tensor (the latent channel's
        # received + ΔW(z)) is recomputed there, a plain parameter is itself
        self.pairs = []
        for name, value in reference.items():
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path) if path else model
            self.pairs.append((module, attr, value.to(getattr(module, attr).device)))

    def penalty(self) -> torch.Tensor:
        return 0.5 * self.mu * sum(((getattr(m, a) - r) ** 2).sum() for m, a, r in self.pairs)


def local_train(
    model,
    task,
    train_cfg,
    *,
    seed: int,
    hooks: TrainHooks | None = None,
    steps: int | None = None,
    proximal_mu: float = 0.0,
    reference: dict[str, torch.Tensor] | None = None,
    lr_by_name: Mapping[str, float] | None = None,
) -> dict[str, float | int]:
    """Run ``steps`` (default ``train_cfg.local_steps``) AdamW steps on the client's training split.

    The model stays in eval mode (no dropout; BatchNorm keeps its pretrained statistics),
    so a round is a deterministic function of (global state, data, seed). ``hooks`` add a
    method's terms to the loss and observe each step (:class:`TrainHooks`); with
    ``proximal_mu > 0`` the FedProx term over the ``reference`` tensors (the global values
    received this round) is the hook. ``lr_by_name``: learning rates of their own for the
    parameters whose names contain its keys (:func:`parameter_groups`).
    """
    torch.set_num_threads(max(1, int(train_cfg.get("threads", 1))))
    groups = parameter_groups(model, float(train_cfg.lr), lr_by_name)
    params = [p for group in groups for p in group["params"]]
    if proximal_mu > 0:
        if hooks is not None:
            raise TrainingError("pass either proximal_mu or hooks, not both")
        hooks = Proximal(model, proximal_mu, reference)
    optimizer = torch.optim.AdamW(groups, weight_decay=float(train_cfg.get("weight_decay", 0.0)))
    rng = np.random.default_rng(seed)
    losses = []
    start = time.perf_counter()
    model.eval()
    steps = int(train_cfg.local_steps) if steps is None else int(steps)
    every = float(train_cfg.get("progress_seconds", 30) or 0)  # a progress line at most this often; 0 = none
    last_report = start
    with grad_checkpointing(model, bool(train_cfg.get("grad_checkpointing", False))):
        for batch in task.train_batches(steps, int(train_cfg.batch_size), rng):
            with autocast(model):  # forward only; backward runs outside autocast, as PyTorch recommends
                loss = task.loss(model, batch)
            if not torch.isfinite(loss):
                raise TrainingError(f"the training loss became {loss.item()}; lower train.lr (now {train_cfg.lr})")
            losses.append(loss.item())
            if hooks is not None:
                if hooks.data_weight != 1.0:
                    loss = hooks.data_weight * loss
                loss = loss + hooks.penalty()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if hooks is not None:
                hooks.after_backward()
            clip = float(train_cfg.get("max_grad_norm", 0.0) or 0.0)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            if hooks is not None:
                hooks.after_step()
            now = time.perf_counter()
            if every and now - last_report >= every and len(losses) < steps:
                per_step = (now - start) / len(losses)
                log(INFO, "local training%s: step %d/%d, loss %.4f, %.2f s/step, ~%.0f s left", PROGRESS_LABEL.get(),
                    len(losses), steps, losses[-1], per_step, per_step * (steps - len(losses)))
                last_report = now
    optimizer.zero_grad(set_to_none=True)
    metrics = {
        "loss": float(np.mean(losses)),
        "first-loss": float(losses[0]),
        "last-loss": float(losses[-1]),
        "seconds": time.perf_counter() - start,
        "num-examples": int(task.num_train),
    }
    if hooks is not None:
        metrics.update(hooks.metrics())
    return metrics


def evaluate(model, task, eval_cfg) -> dict[str, float | int]:
    start = time.perf_counter()
    model.eval()
    with torch.no_grad(), autocast(model):
        metrics = task.evaluate(model, int(eval_cfg.batch_size), int(eval_cfg.max_batches))
    if not all(math.isfinite(float(v)) for v in metrics.values()):
        raise TrainingError(f"evaluation produced non-finite metrics: {metrics}")
    metrics["seconds"] = time.perf_counter() - start
    return metrics


def local_metrics(model, task, eval_cfg) -> dict[str, float]:
    """A client's own freshly trained model, scored on its test split before aggregation.

    ``local-<metric>`` against the federated model's ``<metric>`` after aggregation is the
    aggregation drop (``algorithm.eval_local``).
    """
    metrics = evaluate(model, task, eval_cfg)
    return {f"local-{task.metric}": metrics[task.metric], "local-loss": metrics["loss"]}
