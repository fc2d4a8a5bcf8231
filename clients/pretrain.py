"""θ_pre for ``base=public``: a vision backbone trained centrally on the task's public split.

FLITE's premise is the federated fine-tuning of a base that already knows the task. Here
that base is made from what this machine has: the model group's weights (ImageNet
MobileNetV2, a checkpoint, or a random init) trained on a server-side public split
(``task.public_fraction`` of every class, disjoint from every client's data:
``clients.partition.public_split``) *with FLITE's frozen orthogonal classifier already in
place* (seed ``base.seed``, gain ``base.head_gain``), so every method that starts from it
(FLITE, the LoRA baselines, full FedAvg and its compressed variants) shares one θ_pre and
one head.

``base_checkpoint(cfg)`` is the file a run loads (``clients.models.build_model``);
``ensure_base(cfg)`` trains it once (progress logged) and saves it as safetensors under
``$POSTCARD_CACHE/pretrained-<model>-<dataset>-<key>/`` (with ``report.json``: held-out
accuracy before/after, time), keyed by every setting that shapes it (backbone, task, split,
seed, optimiser); later runs reuse it. ``postcard pretrain <overrides>``
(``postcard.pretrain``) and the server of a ``base=public`` run call it.
"""

from __future__ import annotations

import json
import time
from logging import INFO
from pathlib import Path

from flwr.common.logger import log
from omegaconf import OmegaConf

from clients.assets import cached_folder
# θ_pre's file and key, below clients.models (which loads it) and this module (which trains it); re-exported
from clients.models.base import (FILE, FORMAT, REPORT, base_checkpoint, base_folder_name, base_key,  # noqa: F401
                                 base_settings)

def ensure_base(cfg) -> Path:
    """θ_pre's file, trained now (once, under a lock) when this machine has none."""
    folder = cached_folder(base_folder_name(cfg), lambda out: _pretrain(cfg, out))
    return folder / FILE


def read_report(cfg) -> dict:
    """What the pretraining measured (accuracy on the held-out public images before/after, time)."""
    return json.loads((ensure_base(cfg).parent / REPORT).read_text())


def _pretrain(cfg, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from clients.models.heads import orthogonal_head_
    from clients.models import vision_model
    from clients.models.weights import head_prefix
    from clients.tasks.image import ImageTask
    from clients.train import evaluate, local_train

    base = cfg.base
    model = vision_model(cfg, cfg.model.get("path"))
    orthogonal_head_(model.head, seed=int(base.seed), gain=float(base.head_gain))
    head = head_prefix(model)
    for name, param in model.named_parameters():  # the backbone trains; the head stays as drawn
        param.requires_grad_(not name.startswith(head))
    task = ImageTask.public(cfg)
    log(INFO, "pretraining θ_pre: %s on %d public %s images (%.0f%% of each class; %d held out), %d steps of %d, "
        "lr %g -> %s", cfg.model.name, task.num_train + task.num_test, cfg.task.dataset,
        100 * float(cfg.task.public_fraction), task.num_test, int(base.steps), int(base.batch_size),
        float(base.lr), base_folder_name(cfg))
    eval_cfg = OmegaConf.create({"batch_size": 64, "max_batches": 0})
    before = evaluate(model, task, eval_cfg)
    train_cfg = OmegaConf.create({"lr": float(base.lr), "local_steps": int(base.steps),
                                  "batch_size": int(base.batch_size), "weight_decay": float(base.weight_decay),
                                  "max_grad_norm": 1.0, "threads": int(base.get("threads", 1)),
                                  "progress_seconds": 15})
    start = time.time()
    metrics = local_train(model, task, train_cfg, seed=int(base.seed))
    seconds = time.time() - start
    after = evaluate(model, task, eval_cfg)
    log(INFO, "θ_pre: held-out public accuracy %.4f -> %.4f after %d steps (%.0f s, final loss %.4f)",
        before["accuracy"], after["accuracy"], int(base.steps), seconds, metrics["last-loss"])
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / FILE), metadata={"format": FORMAT, "head": "orthogonal",
                                               "settings": json.dumps(base_settings(cfg), sort_keys=True)})
    report = {"settings": base_settings(cfg), "key": base_key(cfg), "public_images": task.num_train + task.num_test,
              "held_out": task.num_test, "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
              "seconds": seconds, "torch": torch.__version__, "cpu": _cpu_name()}
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")


def _cpu_name() -> str:
    """The CPU θ_pre was trained on: the same settings gave two different θ_pre on two machines
    (0.750 and 0.770 held-out accuracy)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SENSITIVITY = "sensitivity.json"
SENSITIVITY_BATCHES = 8  # batches of 64 public training images (fixed order): 512 images


def base_sensitivity(cfg) -> dict[str, float]:
    """Each weight layer's sensitivity at θ_pre: the Frobenius norm of the loss's gradient with
    respect to its weight, ``sqrt(mean over batches of ‖∂L/∂W‖²)``, on 8 fixed batches of 64 of the
    public split's training images (the head frozen, as in every run), rounded to 4 significant
    digits. FLITE's ``split=sensitivity`` shares its latents by it (``clients.flite.split_weights``).

    Measured once per θ_pre and cached beside it (``<θ_pre's folder>-sensitivity``); a client on
    another machine measures the same numbers from the same θ_pre and public split (or copies the
    folder), and a layout that still differed would be refused by FLITE's fingerprint."""
    folder = cached_folder(base_folder_name(cfg) + "-sensitivity", lambda out: _measure_sensitivity(cfg, out))
    return json.loads((folder / SENSITIVITY).read_text())["sensitivity"]


def _measure_sensitivity(cfg, out: Path) -> None:
    import numpy as np
    import torch
    from torch import nn

    from clients.models import build_model
    from clients.models.weights import head_prefix
    from clients.tasks.image import ImageTask

    ensure_base(cfg)
    model, _ = build_model(cfg)  # θ_pre, with the head it was trained under
    head = head_prefix(model)
    task = ImageTask.public(cfg)
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and not f"{name}.".startswith(head)}
    squares = dict.fromkeys(layers, 0.0)
    for module in layers.values():
        module.weight.requires_grad_(True)
    model.train()
    torch.manual_seed(int(cfg.base.seed))
    batches = task.train_batches(SENSITIVITY_BATCHES, 64, np.random.default_rng(int(cfg.base.seed)))
    with torch.enable_grad():
        for batch in batches:
            model.zero_grad(set_to_none=True)
            task.loss(model, batch).backward()
            for name, module in layers.items():
                squares[name] += float(module.weight.grad.double().pow(2).sum())
    sensitivity = {name: float(f"{(total / SENSITIVITY_BATCHES) ** 0.5:.4g}") for name, total in squares.items()}
    log(INFO, "θ_pre's layer sensitivities (gradient norms on %d public images): %.3g .. %.3g over %d layers",
        SENSITIVITY_BATCHES * 64, min(sensitivity.values()), max(sensitivity.values()), len(sensitivity))
    (out / SENSITIVITY).write_text(json.dumps({"key": base_key(cfg), "batches": SENSITIVITY_BATCHES,
                                               "batch_size": 64, "sensitivity": sensitivity}, indent=1) + "\n")
