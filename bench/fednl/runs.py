"""What every section's runs share: the repository root on ``sys.path`` and the offline
environment, the MMLU clients, an algorithm spec's overrides and result key, a Flower simulation
timed, a run's final (or untrained) model and its training loss by round."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

MODULE = "bench.fednl"  # the benchmark runs as ``python -m bench.fednl`` from the repository root
MMLU_CLIENTS = ("law_ethics", "humanities", "stem", "math_cs", "medicine_psychology")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def algorithm_overrides(spec: str, fednl_overrides=(), fedala_overrides=()) -> tuple[str, list[str]]:
    """'fednl:gate' -> ('fednl', ['algorithm.mode=gate']); 'fednl:ablate' -> FedNL's own ablation (meta-rules
    with the memory path off: algorithm.ablate_memory=true); 'fedala' -> ('fedala', [...caps]).
    ``fednl_overrides`` (``--fednl-overrides``) go to every FedNL run, its ablation included;
    ``fedala_overrides`` (``--fedala-overrides``) to FedALA's, after its caps (so they can change them)."""
    name, _, mode = spec.partition(":")
    overrides = []
    if name == "fednl" and mode == "ablate":
        overrides += ["algorithm.mode=meta-rules", "algorithm.ablate_memory=true"]
    elif name == "fednl":
        overrides.append(f"algorithm.mode={mode or 'meta-rules'}")
    elif mode:
        raise SystemExit(f"only fednl takes a mode, got '{spec}'")
    overrides.append("algorithm.eval_local=true")  # every method reports its aggregation drop
    if name == "fednl":
        overrides += list(fednl_overrides)
    if name == "fedala":  # the start phase: at most 2 passes of 4 batches on 2 cores
        overrides += ["algorithm.ala.max_batches=4", "algorithm.ala.max_start_epochs=2", *fedala_overrides]
    if name == "fedssi":
        overrides += ["algorithm.ssi.psm_steps=2"]
    return name, overrides


def run(cfg) -> dict:
    from fedapps.simulation import simulate

    start = time.time()
    summary = simulate(cfg)
    summary["bench_seconds"] = time.time() - start
    return summary


def common(args) -> list[str]:
    return [f"seed={args.seed}", f"train.lr={args.lr}", f"train.batch_size={args.batch_size}",
            "train.threads=1", "eval.batch_size=8"]


def spec_key(spec: str) -> str:
    """The NIAH, lm and stream result key of an algorithm spec: fednl, fednl-ablate, fedavg-lora."""
    return {"fednl:meta-rules": "fednl", "fednl:ablate": "fednl-ablate"}.get(spec, spec.replace(":", "-"))


ROUND0 = {"backbone": "fedavg-lora", "fednl at init": "fednl:meta-rules"}  # the untrained models, built as these


def round0_of(spec: str) -> str:
    """The untrained model a run starts from: FedNL's memory at init (a = 0.018) for FedNL's payload
    modes; the bare backbone for every LoRA method and for FedNL's ablation (a = 0: the backbone, bit
    for bit, with LoRA's B = 0; tested in tests/test_fednl_app.py)."""
    return "fednl at init" if spec.startswith("fednl") and spec != "fednl:ablate" else "backbone"


def load_trained(cfg, summary: dict):
    """The final global model of a run (FedNL θ, or a PEFT adapter merged into the backbone);
    with no ``final_state``, the untrained one (FedNL at init, or the bare backbone)."""
    if summary.get("final_state") is None:
        from clients.models import build_model
        from fedapps.fednl import prepare

        model, tokenizer = prepare(cfg)[:2] if cfg.algorithm.name == "fednl" else build_model(cfg)
        return model.eval(), tokenizer
    if cfg.algorithm.name == "fednl":
        from fedapps.fednl import load_final

        model, tokenizer = load_final(cfg, summary["final_state"])
        return model, tokenizer
    from peft import PeftModel

    from clients.models import build_model

    base, tokenizer = build_model(cfg)
    model = PeftModel.from_pretrained(base, summary["final_state"]).merge_and_unload()
    return model.eval(), tokenizer


def train_losses(run_dir) -> list[float]:
    """The clients' mean retrieval loss (the answer letter's cross-entropy over the full vocabulary): at
    the first step of round 1, then each round's training loss: whether training moved it at all."""
    import numpy as np

    from fedapps.outputs import read_metrics

    rounds = [r for r in read_metrics(run_dir) if any("train_loss" in c for c in r["clients"])]
    if not rounds:
        return []
    first = [c["train_first-loss"] for c in rounds[0]["clients"] if "train_first-loss" in c]
    means = [float(np.mean([c["train_loss"] for c in r["clients"] if "train_loss" in c])) for r in rounds]
    return ([float(np.mean(first))] if first else []) + means
