"""FLITE (fp32 and int4 latents) against full-weight and compressed-update baselines on CIFAR-10.

    .venv/bin/python bench/flite.py                            # ~45-60 min on 2 cores
    .venv/bin/python bench/flite.py --rounds 2 --steps 3 --partitions iid \\
        --methods flite-int4 fedavg-full --out /tmp/flite-smoke   # a smoke test in a few minutes

Every method is a Flower simulation of the same harness (``fedapps.simulation.simulate``):
the embedded ImageNet MobileNetV2 on the CIFAR-10 images of the bigbench package (64 px),
``--clients`` clients, label skew ``dirichlet(alpha=0.1)`` and IID, the same rounds, local
steps, batch size and seed; the learning rate is per method (``--lr METHOD=VALUE``), each
evaluated on every client's held-out split (all of it) after every round.

Methods (``--methods``):

=================  =========================================================================
flite-int4         FLITE, latents (1,280) sent as int4 updates both ways: 648 B per message
flite-fp32         FLITE, latents in fp32: 5,120 B
fedavg-full        every weight of the backbone and head trained; the update sent in fp32
fedavg-full-int4   the same update quantised to int4 per tensor (stochastic rounding)
fedavg-lora        PEFT LoRA r=8 on every 1x1 convolution, FLITE's frozen orthogonal head
topk-ef            full update, top 1% entries per tensor (index + value), error feedback
powersgd           full update, PowerSGD rank 4 per weight matrix, error feedback
=================  =========================================================================

Reported (``OUT/flite.md``, ``flite.json``, ``flite.png``, with the command that made them):
final accuracy per method and partition, uplink payload bytes per client per round, the
ratio of fedavg-full's bytes to the method's, and a plot of accuracy against cumulative
uplink bytes per client (the Pareto view), one panel per partition. Targets from the
issue: FLITE-int4 within 1 pp of fedavg-full at >= 10,000x fewer uplink bytes.
Extra Hydra overrides after ``--`` apply to every run (e.g. ``-- task.image_size=32``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# method -> (algorithm, overrides, default learning rate)
METHODS = {
    "flite-int4": ("flite", ["algorithm.payload=int4", "algorithm.downlink=int4"], 1e-2),
    "flite-fp32": ("flite", ["algorithm.payload=fp32", "algorithm.downlink=fp32"], 1e-2),
    "fedavg-full": ("fedavg-full", ["algorithm.payload=fp32"], 1e-4),
    "fedavg-full-int4": ("fedavg-full", ["algorithm.payload=int4"], 1e-4),
    "fedavg-lora": ("fedavg-lora", [], 1e-3),
    "topk-ef": ("topk-ef", [], 1e-4),
    "powersgd": ("powersgd", [], 1e-4),
}
PARTITIONS = {"dirichlet": ["partition=dirichlet", "partition.alpha=0.1"], "iid": ["partition=iid"]}
REFERENCE = "fedavg-full"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="local optimiser steps per client per round")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", action="append", default=[], metavar="METHOD=VALUE",
                   help="learning rate of one method (repeatable); defaults: "
                        + ", ".join(f"{m}={v:g}" for m, (_, _, v) in METHODS.items()))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "flite", help="report folder")
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-flite",
                   help="folder of the 14 run folders (default outputs/bench-flite)")
    p.add_argument("--render", action="store_true", help="only re-write the report and plot from OUT/flite.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    lrs = {m: v for m, (_, _, v) in METHODS.items()}
    for item in args.lr:
        method, _, value = item.partition("=")
        if method not in METHODS:
            p.error(f"--lr: unknown method '{method}'; choose from {', '.join(METHODS)}")
        try:
            lrs[method] = float(value)
        except ValueError:
            p.error(f"--lr {item}: '{value}' is not a number")
        if lrs[method] <= 0:
            p.error(f"--lr {item}: the learning rate must be > 0")
    args.lrs = lrs
    for name in ("rounds", "steps", "batch_size", "clients"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.render and REFERENCE not in args.methods:
        log(f"note: without {REFERENCE} the byte ratios and the accuracy gap are not reported")
    return args


def config_for(args, method: str, partition: str):
    from fedapps.config import compose

    algorithm, overrides, _ = METHODS[method]
    items = [*PARTITIONS[partition], *overrides, f"rounds={args.rounds}", f"num_clients={args.clients}",
             f"seed={args.seed}", f"train.lr={args.lrs[method]}", f"train.local_steps={args.steps}",
             f"train.batch_size={args.batch_size}", "train.threads=1", "eval.max_batches=0",
             "eval.batch_size=64", f"run_name=flite-bench_{partition}_{method}",
             f"output_dir={args.runs}", *args.overrides]
    return compose(items, task="cifar10", algorithm=algorithm, preset="none")


def run_all(args) -> dict:
    from fedapps.outputs import cumulative_curve
    from fedapps.simulation import simulate

    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "lr"}
    results = {"runs": {}, "settings": settings}
    total = len(args.partitions) * len(args.methods)
    done = 0
    for partition in args.partitions:
        for method in args.methods:
            done += 1
            cfg = config_for(args, method, partition)
            log(f"[{done}/{total}] {method} on CIFAR-10 {partition} (lr {args.lrs[method]:g})")
            start = time.time()
            summary = simulate(cfg)
            seconds = time.time() - start
            results["runs"][f"{partition}/{method}"] = {
                "method": method, "partition": partition, "algorithm": summary["algorithm"],
                "lr": args.lrs[method], "initial_accuracy": summary["initial_metric"],
                "final_accuracy": summary["final_metric"],
                "uplink_bytes_per_client_round": summary["uplink_bytes_per_client_round"],
                "downlink_bytes_per_client_round": summary["downlink_bytes_per_client_round"],
                "refused_replies": summary["refused_replies"], "seconds": seconds,
                "curve": cumulative_curve(summary["run_dir"], "accuracy"), "run_dir": summary["run_dir"],
            }
            log(f"    accuracy {summary['initial_metric']:.4f} -> {summary['final_metric']:.4f}, "
                f"uplink {summary['uplink_bytes_per_client_round']:,.0f} B/client/round, {seconds:.0f} s")
            (args.out / "flite.json").write_text(json.dumps(results, indent=2) + "\n")  # partial results survive
    return results


# ---------------------------------------------------------------------------- report
def fmt_bytes(value: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


def report(results: dict, command: str, machine: str) -> str:
    runs = results["runs"]
    s = results["settings"]
    lines = [
        "# FLITE vs full-weight and compressed-update baselines (CIFAR-10, MobileNetV2)",
        "",
        f"Made by `{command}` on {machine}, {time.strftime('%Y-%m-%d')}.",
        f"{s['clients']} clients, {s['rounds']} rounds × {s['steps']} local steps of {s['batch_size']} images "
        f"(64 px), seed {s['seed']}; accuracy over every client's held-out split after the last round.",
        "Uplink = payload bytes per client per round (the arrays' data; Flower's message framing adds ~0.4 kB "
        "per tensor, see `uplink_message_bytes` in each run's summary.json).",
        "",
    ]
    verdicts = []
    for partition in s["partitions"]:
        ref = runs.get(f"{partition}/{REFERENCE}")
        label = "Dirichlet α=0.1" if partition == "dirichlet" else "IID"
        lines += [f"## {label}", "", "| method | lr | accuracy (round 0 → final) | uplink B/client/round | "
                  f"{REFERENCE} bytes ÷ method bytes | Δ accuracy vs {REFERENCE} (pp) | wall |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for method in s["methods"]:
            run = runs.get(f"{partition}/{method}")
            if run is None:
                continue
            ratio = f"{ref['uplink_bytes_per_client_round'] / run['uplink_bytes_per_client_round']:,.0f}×" if ref else "–"
            gap = f"{100 * (run['final_accuracy'] - ref['final_accuracy']):+.1f}" if ref else "–"
            lines.append(f"| {method} | {run['lr']:g} | {run['initial_accuracy']:.3f} → **{run['final_accuracy']:.3f}** "
                         f"| {run['uplink_bytes_per_client_round']:,.0f} ({fmt_bytes(run['uplink_bytes_per_client_round'])}) "
                         f"| {ratio} | {gap} | {run['seconds'] / 60:.1f} min |")
        lines.append("")
        flite = runs.get(f"{partition}/flite-int4")
        if ref and flite:
            gap = 100 * (flite["final_accuracy"] - ref["final_accuracy"])
            ratio = ref["uplink_bytes_per_client_round"] / flite["uplink_bytes_per_client_round"]
            verdicts.append(f"- {label}: FLITE-int4 is {gap:+.1f} pp from {REFERENCE} (target ≥ −1 pp: "
                            f"**{'met' if gap >= -1 else 'not met'}**) at {ratio:,.0f}× fewer uplink bytes "
                            f"(target ≥ 10,000×: **{'met' if ratio >= 10_000 else 'not met'}**).")
    if verdicts:
        lines += ["## Targets", "", *verdicts, ""]
    lines += ["![accuracy vs cumulative uplink bytes](flite.png)", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedapps.outputs import draw_curves

    partitions = results["settings"]["partitions"]
    fig, axes = plt.subplots(1, len(partitions), figsize=(6.5 * len(partitions), 4.6), squeeze=False)
    for ax, partition in zip(axes[0], partitions):
        curves = {m: results["runs"][f"{partition}/{m}"]["curve"] for m in results["settings"]["methods"]
                  if f"{partition}/{m}" in results["runs"]}
        label = "Dirichlet α=0.1" if partition == "dirichlet" else "IID"
        draw_curves(ax, curves, "accuracy", f"CIFAR-10, {label} (hollow: round 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> str:
    import os
    import platform

    return f"{platform.machine()} Linux, {os.cpu_count()} CPU cores, torch CPU"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = ("bench/flite.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))).strip()
    if args.render:
        results = json.loads((args.out / "flite.json").read_text())
        command = results.get("command", command)
    else:
        results = run_all(args)
        results["command"] = command
        (args.out / "flite.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "flite.png")
    text = report(results, results["command"], machine())
    (args.out / "flite.md").write_text(text)
    print(text)
    log(f"report: {args.out / 'flite.md'}; plot: {args.out / 'flite.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
