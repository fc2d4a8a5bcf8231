"""Section 5, ``lm``: held-out Shakespeare loss past FedNL's softmax window, of the untrained
backbone and of FedNL, its ablation and fedavg-lora after federated rounds."""

from __future__ import annotations

from pathlib import Path

from .runs import algorithm_overrides, common, load_trained, log, run, spec_key, train_losses
from .stats import loss_diffs


def lm_cfg(args, out: Path, spec: str, run_name: str, **memory):
    """A 4-client Shakespeare run (one play each) on ``--lm-seq``-token windows; FedNL's softmax path
    sees its sinks and the last ``--lm-window`` tokens, the memory the rest (``memory``: overrides of
    algorithm.memory, e.g. ``sink=0``)."""
    from fedapps.config import compose

    name, overrides = algorithm_overrides(spec, args.fednl_overrides)
    if name == "fednl":
        overrides += [f"algorithm.memory.window={args.lm_window}", "algorithm.eval_local=false",
                      *(f"algorithm.memory.{k}={v}" for k, v in memory.items())]
    return compose(
        [*common(args), *overrides, f"model={args.model}", f"rounds={args.lm_rounds}", "num_clients=4",
         f"train.local_steps={args.lm_steps}", "train.batch_size=2", f"train.seq_len={args.lm_seq}",
         "eval.batch_size=2", "eval.max_batches=0", "strategy.fraction_evaluate=0.0",
         f"output_dir={out}", f"run_name={run_name}"],
        task="shakespeare", algorithm=name,
    )


def section_lm(args, out: Path) -> dict:
    """What the memory adds where the softmax path cannot see: held-out Shakespeare loss, window by
    window, of (a) the untrained backbone with full attention, with a ``--lm-window`` window and no
    sinks, and with the window and 4 sinks; (b) FedNL, its ablation (the same window and sinks,
    memory off) and fedavg-lora (full attention) after ``--lm-rounds`` federated rounds; FedNL paired
    against its ablation (paired t on the per-window losses), α per layer at the end."""
    import numpy as np
    import torch

    from fedapps.final import FinalModel, load_run

    torch.set_num_threads(args.threads)
    items, runs = {}, {}
    ablate = lm_cfg(args, out, "fednl:ablate", "lm_init")
    for label, cfg in (("backbone, full attention", lm_cfg(args, out, "fedavg-lora", "lm_init")),
                       (f"backbone, window {args.lm_window}, no sinks", lm_cfg(args, out, "fednl:ablate", "lm_init",
                                                                               sink=0)),
                       (f"backbone, window {args.lm_window} + {ablate.algorithm.memory.sink} sinks", ablate)):
        log(f"lm: scoring the untrained {label}")
        model, tokenizer = load_trained(cfg, {})
        folder = out / f"lm_init_{len(items)}"
        folder.mkdir(parents=True, exist_ok=True)
        items[f"init: {label}"] = FinalModel(model, tokenizer, cfg, folder, {}).items()
        del model
    for spec in args.lm_algorithms:
        key = spec_key(spec)
        cfg = lm_cfg(args, out, spec, f"lm_{key}")
        log(f"lm: training {key} ({cfg.rounds} round(s) of {cfg.train.local_steps} steps, {args.lm_seq}-token windows)")
        summary = run(cfg)
        final = load_run(summary["run_dir"])  # its config already scores every held-out window
        items[key] = final.items()
        alpha = summary.get("final_gate_alpha")
        runs[key] = {"run_dir": summary["run_dir"], "final_state": summary.get("final_state"),
                     "train_seconds": summary.get("bench_seconds"),
                     "uplink_bytes": summary.get("uplink_bytes_per_client_round"),
                     "train_loss": train_losses(summary["run_dir"]),
                     "alpha": None if alpha is None else [float(a) for a in np.ravel(alpha)]}
        del final
    losses = {name: float(np.mean(r["loss"])) for name, r in items.items()}
    result = {"window": args.lm_window, "seq": args.lm_seq, "windows": len(next(iter(items.values()))["loss"]),
              "rounds": args.lm_rounds, "steps": args.lm_steps, "loss": losses, "runs": runs}
    if "fednl-ablate" in items:
        result["vs_ablation"] = loss_diffs(items, "fednl-ablate", [k for k in items if k.startswith("fednl")
                                                                     and k != "fednl-ablate"])
    if "fedavg-lora" in items:
        result["vs_fedavg_lora"] = loss_diffs(items, "fedavg-lora", [k for k in items if k != "fedavg-lora"])
    return result
