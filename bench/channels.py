"""Method × channel: uplink bytes per client per round, and the metric after the same rounds.

    .venv/bin/python bench/channels.py            # ~40 min on 2 cores; writes docs/bench/channels/
    .venv/bin/python bench/channels.py --quick    # tiny-llama, 2 rounds, 1 seed: a few minutes

Two parts, each method through its own wire format (``channel=method``) and every channel
it carries (``conf/algorithm/<name>.yaml``: ``channels``; docs/channels.md):

* **Language** — SmolLM2-135M (``--quick``: the tiny random-init Llama), Shakespeare, 2
  clients, ``--rounds`` (2) rounds of the demo preset (4 local steps of 4×128 tokens, lr 1e-3;
  FLITE at lr 1e-2 as in the demo): fedavg-lora, FedNL, SmartFed (its pool: the demo's
  two sources, built first when missing), FLITE. Metric: held-out perplexity. One seed
  by default (``--lm-seeds``): these rows show what each channel costs in bytes and
  whether the method still learns, not differences of a few percent.
* **Vision** — CIFAR-10, the tiny CNN from θ_pre (``base=public``), 10 IID clients,
  ``--vision-rounds`` (5) rounds: fedavg-full and FLITE, ``--seeds`` (3) seeds (mean and 95% t-interval).

Written: ``OUT/channels.md``, ``OUT/channels.json`` and ``OUT/channels.png`` (metric vs uplink
bytes per client per round, log scale).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

LM_METHODS = {"fedavg-lora": [], "fednl": [], "smartfed": [], "flite": ["train.lr=1e-2"]}
LM_COMMON = ["num_clients=2", "eval.max_batches=4"]
VISION_METHODS = {"fedavg-full": ["train.lr=3e-3"], "flite": ["algorithm.flite.latent_budget=256", "train.lr=0.05"]}
VISION_COMMON = ["model=tiny-cnn", "partition=iid", "num_clients=10", "train.local_steps=15", "train.batch_size=32",
                 "eval.max_batches=4", "eval.batch_size=64", "base=public", "base.steps=40", "base.lr=3e-3",
                 "base.batch_size=32"]
# the latent channel over full weights trains better at a larger step (3e-3, 1e-2, 3e-2 tried on
# Fashion-MNIST without DP, seed 0: bench/privacy.py)
CHANNEL_OVERRIDES = {("fedavg-full", "latent"): ["train.lr=1e-2", "channel.latents=256"]}


def channels_of(algorithm: str, task: str, model: str) -> list[str]:
    """``method`` and every channel the method carries, less those that send what the method already sends."""
    from fedapps.config import compose

    def wire(channel: str):
        a = compose([f"model={model}"], task=task, algorithm=algorithm, channel=channel, preset="none").algorithm
        return str(a.payload), str(a.get("uplink")), str(a.get("compression"))

    own = wire("method")
    cfg = compose([f"model={model}"], task=task, algorithm=algorithm, preset="none")
    carried = [str(c) for c in cfg.algorithm.get("channels") or []]
    return ["method", *[c for c in carried if c == "latent" or wire(c) != own]]


def run(task: str, algorithm: str, channel: str, overrides: list[str], out: Path, name: str) -> dict:
    from fedapps.config import compose
    from fedapps.simulation import simulate

    extra = list(CHANNEL_OVERRIDES.get((algorithm, channel), []))
    if channel == "latent" and "model=tiny-llama" in overrides:
        extra.append("channel.rank=128")  # the tiny model's tensors hold fewer than 1,280 latents at rank 64
    cfg = compose([*overrides, *extra, f"channel={channel}", f"output_dir={out}", f"run_name={name}"],
                  task=task, algorithm=algorithm, preset="demo" if task == "shakespeare" else "none")
    started = time.time()
    done = out / name / "summary.json"
    if done.is_file() and json.loads(done.read_text()).get("status") == "completed":
        summary = json.loads(done.read_text())  # a finished run of the same name: reused (delete it to rerun)
        print(f"[reused] {done}", flush=True)
    else:
        summary = simulate(cfg)
    return {"algorithm": algorithm, "channel": channel, "payload": str(cfg.algorithm.payload),
            "metric": summary.get("metric"), "initial": summary["initial_metric"], "final": summary["final_metric"],
            "uplink": summary["uplink_bytes_per_client_round"], "seconds": round(time.time() - started, 1)}


def ensure_pool(model: str) -> None:
    from postcard import demo

    demo.ensure_pool(Namespace(pool=None, model=model), ROOT / "outputs" / "bench-channels" / "pool-runs")


def interval(values: list[float]) -> str:
    from postcard.compare import paired_interval

    if len(values) == 1:
        return f"{values[0]:.4g}"
    mean, low, high = paired_interval(np.asarray(values, np.float64), t=True)
    return f"{mean:.4g} [{low:.4g}, {high:.4g}]"


def table(rows_by_key: dict, title: str, metric: str) -> list[str]:
    lines = [f"### {title}", "", f"| method | channel | wire | uplink bytes / client / round | × method's own | "
             f"{metric} round 0 | {metric} final (95% CI when seeds > 1) | runs |", "|---|---|---|---|---|---|---|---|"]
    own = {a: rows[0]["uplink"] for (a, c), rows in rows_by_key.items() if c == "method"}
    for (algorithm, channel), rows in rows_by_key.items():
        up = rows[0]["uplink"]
        ratio = f"{up / own[algorithm]:.3g}" if algorithm in own else "—"
        lines.append(f"| {algorithm} | {channel} | {rows[0]['payload']} | {up:,.0f} | {ratio} | "
                     f"{rows[0]['initial']:.4g} | {interval([r['final'] for r in rows])} | {len(rows)} |")
    return lines + [""]


def plot(parts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.2))
    axes = np.atleast_1d(axes)
    for ax, (title, (rows_by_key, metric)) in zip(axes, parts.items()):
        for (algorithm, channel), rows in rows_by_key.items():
            ax.scatter(rows[0]["uplink"], np.mean([r["final"] for r in rows]), s=30)
            ax.annotate(f"{algorithm}/{channel}", (rows[0]["uplink"], np.mean([r["final"] for r in rows])),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("uplink bytes per client per round")
        ax.set_ylabel(metric)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama, one seed, vision with 2 rounds")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the language part")
    parser.add_argument("--vision-rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the vision part")
    parser.add_argument("--lm-seeds", type=int, default=1, help="seeds of the language part")
    parser.add_argument("--model", default="smollm2", help="the language part's model (smollm2 | tiny-llama)")
    parser.add_argument("--parts", nargs="+", default=["language", "vision"], choices=["language", "vision"])
    parser.add_argument("--lm-methods", nargs="+", default=list(LM_METHODS), choices=list(LM_METHODS))
    parser.add_argument("--channels", nargs="+", default=None, help="only these channels (default: every one carried)")
    parser.add_argument("--extra", default="", help="more Hydra overrides for every run (e.g. \"train.lr=1e-2\")")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-channels")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "channels")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.vision_rounds, args.seeds, args.lm_seeds = "tiny-llama", 2, 2, 1, 1
    command = "python bench/channels.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    started = time.time()
    results: dict[str, dict] = {}
    if "language" in args.parts:
        if "smartfed" in LM_METHODS:
            ensure_pool(args.model)
        rows: dict = {}
        for algorithm in args.lm_methods:
            own = LM_METHODS[algorithm]
            for channel in channels_of(algorithm, "shakespeare", args.model):
                if args.channels and channel not in args.channels:
                    continue
                for seed in range(args.lm_seeds):
                    row = run("shakespeare", algorithm, channel,
                              [f"model={args.model}", f"rounds={args.rounds}", f"seed={seed}", *LM_COMMON, *own,
                               *shlex.split(args.extra)],
                              args.runs, f"lm-{algorithm}-{channel}-s{seed}")
                    rows.setdefault((algorithm, channel), []).append(row)
                    print(f"[language] {algorithm} / {channel} seed {seed}: {row['uplink']:,.0f} B, "
                          f"{row['metric']} {row['initial']:.4g} -> {row['final']:.4g} ({row['seconds']} s)", flush=True)
        results["language"] = rows
    if "vision" in args.parts:
        rows = {}
        for algorithm, own in VISION_METHODS.items():
            for channel in channels_of(algorithm, "cifar10", "tiny-cnn"):
                if args.channels and channel not in args.channels:
                    continue
                for seed in range(args.seeds):
                    row = run("cifar10", algorithm, channel, [*VISION_COMMON, f"rounds={args.vision_rounds}",
                                                              f"seed={seed}", *own, *shlex.split(args.extra)],
                              args.runs, f"vision-{algorithm}-{channel}-s{seed}")
                    rows.setdefault((algorithm, channel), []).append(row)
                    print(f"[vision] {algorithm} / {channel} seed {seed}: {row['uplink']:,.0f} B, "
                          f"accuracy {row['initial']:.3f} -> {row['final']:.3f} ({row['seconds']} s)", flush=True)
        results["vision"] = rows
    minutes = (time.time() - started) / 60
    lines = ["# Method × channel", "", f"Made by `{command}` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, {minutes:.0f} min)."
             " Uplink bytes: the payload of one client's training reply (docs/benchmarks.md has what Flower's framing "
             "adds). `× method's own`: against the method's own wire format (`channel=method`).", ""]
    parts = {}
    if "language" in results:
        lines += table(results["language"], f"Language: {args.model}, Shakespeare, 2 clients, {args.rounds} rounds "
                                            f"(demo preset), {args.lm_seeds} seed(s); held-out perplexity (lower is "
                                            "better)", "perplexity")
        parts[f"{args.model} / Shakespeare"] = (results["language"], "perplexity")
    if "vision" in results:
        lines += table(results["vision"], f"Vision: CIFAR-10, tiny CNN from θ_pre, 10 IID clients, {args.vision_rounds} "
                                          f"rounds, seeds 0..{args.seeds - 1}; held-out accuracy", "accuracy")
        parts["tiny CNN / CIFAR-10"] = (results["vision"], "accuracy")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(parts, args.out / "channels.png")
    lines += ["![metric vs uplink bytes](channels.png)", ""]
    (args.out / "channels.md").write_text("\n".join(lines) + "\n")
    (args.out / "channels.json").write_text(json.dumps(
        {"command": command, "minutes": round(minutes, 1),
         "results": {part: [r for rows in by.values() for r in rows] for part, by in results.items()}},
        indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
