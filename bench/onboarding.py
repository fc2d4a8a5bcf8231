"""Onboarding a new domain: SmartFed from a knowledge pool vs FedAvg-LoRA from scratch, over seeds.

    .venv/bin/python bench/onboarding.py --clients 4 --rounds 8 --seeds 3   # SmolLM2, the docs protocol (~35 min a seed)
    .venv/bin/python bench/onboarding.py --quick         # tiny model, 1 seed, 2 rounds: ~1.5 min, outputs/bench-onboarding-quick
    .venv/bin/python bench/onboarding.py --seed-list 42 --out /tmp/part-42     # in parts (a seed a session) ...
    .venv/bin/python bench/onboarding.py --merge /tmp/part-42/onboarding.json /tmp/part-43/onboarding.json  # ... merged

The scenario of SmartFed's seed: a federation has fine-tuned LoRA adapters on its domains
(here: ``postcard pool build`` runs one short federated LoRA fine-tuning per
``--pool-sources`` entry and adds its adapter to a pool, exactly what ``postcard pool add
RUN`` does for a finished run); clients with a *new* domain (``--task``, whose data the
script checks is not in the pool) then join. SmartFed starts from the pool's experts,
FedAvg-LoRA from scratch; both get the same clients, rounds, local steps, learning rate
and seed, repeated for ``--seeds`` seeds from 42 (the seed draws the clients' data order,
the LoRA init and the router; the pool is built once, with seed 42).

Reported (``OUT/onboarding.md``, ``.json``, ``.png``): per method the metric by round
(mean over seeds), and for each target (``--targets``; default: the metric FedAvg-LoRA
reaches halfway through, averaged over seeds) the rounds and the cumulative uplink bytes
per client until the federated model first reaches it (seeds that never reach it are
counted as not reached), with the paired difference over seeds. The runs are
``bench/smartfed.py``'s (same pool builder, same unseen-data check, same simulation).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from postcard import pool as pool_cli  # noqa: E402
from postcard.stats import mean_half_width  # noqa: E402
from fedapps.config import compose  # noqa: E402
from smartfed import (HIGHER_IS_BETTER, add_run_arguments, check_unseen, first_round_reaching,  # noqa: E402
                      quick_argv, run_one, write_outputs)  # (bench/smartfed.py)

METHODS = ("fedavg-lora", "smartfed")


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95% t-interval (None for one value): ``postcard.stats.mean_half_width``."""
    mean, half = mean_half_width(values)
    return mean, (half if len(values) > 1 else None)


def fmt(value: float, half: float | None, digits: int = 2) -> str:
    return f"{value:,.{digits}f}" + ("" if half is None else f" ± {half:,.{digits}f}")


def reaching(run: dict, goal: float, higher: bool) -> tuple[int | None, float | None]:
    """The first round whose federated metric reaches ``goal`` and the uplink bytes per client until then."""
    first = first_round_reaching(run["metric_by_round"], goal, higher)
    return first, (None if first is None else run["cumulative_uplink_bytes"][str(first)])


def within_bytes(runs: dict, r: int) -> int | None:
    """SmartFed's last round whose cumulative uplink bytes are at most FedAvg-LoRA's after round ``r``
    (None if one more SmartFed round, as large as its last, would still fit: its run ended too soon
    to say which of its rounds FedAvg-LoRA's bytes would have paid for)."""
    budget = runs["fedavg-lora"]["cumulative_uplink_bytes"][str(r)]
    sent = {int(k): v for k, v in runs["smartfed"]["cumulative_uplink_bytes"].items()}
    last = max(sent)
    if sent[last] + (sent[last] - sent.get(last - 1, 0)) <= budget:
        return None
    return max(k for k, v in sent.items() if v <= budget)


def default_targets(seeds: dict, rounds: int) -> list[float]:
    """FedAvg-LoRA's metric halfway through the runs, averaged over seeds."""
    halfway = str(max(1, rounds // 2))
    return [statistics.fmean(runs["fedavg-lora"]["metric_by_round"][halfway] for runs in seeds.values())]


def report(results: dict) -> str:
    metric, higher = results["metric"], HIGHER_IS_BETTER.get(results["metric"], True)
    seeds = results["seeds"]
    n = len(seeds)
    lines = [
        f"# Onboarding a new domain: SmartFed from a pool vs FedAvg-LoRA from scratch ({results['target']}, "
        f"{results['model']})",
        "",
        f"Made by: `{results['command']}` ({results['date']}, {results['wall_minutes']:.1f} min wall).",
        "",
    ]
    reused = [f"{m} seed {seed} (`{runs[m]['run_dir']}`)" for seed, runs in seeds.items() for m in METHODS
              if runs[m].get("reused") and not runs[m].get("reference_report")]
    if reused:
        lines += ["Read from completed run folders of the same configuration (`--reuse-runs`), not run again: "
                  + ", ".join(reused) + ".", ""]
    referenced = [f"{m} seed {seed} (`{runs[m]['reference_report']}`)" for seed, runs in seeds.items()
                  for m in METHODS if runs[m].get("reference_report")]
    if referenced:
        lines += ["Taken from earlier reports of the same protocol and overrides (`--reference-from`), not run "
                  "again: " + ", ".join(referenced) + ".", ""]
    lines += [
        f"Pool: {', '.join(results['pool_adapters'])} ({results['pool']}); the target's data "
        f"({results['target_data']}) is in none of them. {results['clients']} clients, {results['rounds']} rounds × "
        f"{results['steps']} local steps, lr {results['lr']}, seeds {', '.join(seeds)} (n = {n}; ± = 95% "
        "t-interval over seeds)." + "".join(f" {name} with `{overrides_of(results, m)}`."
                                             for m, name in (("fedavg-lora", "FedAvg-LoRA"), ("smartfed", "SmartFed"))
                                             if overrides_of(results, m)),
        "",
        f"## {metric} by round (mean over seeds)",
        "",
        "| round | " + " | ".join(METHODS) + " | smartfed − fedavg-lora, paired |",
        "|---|" + "---:|" * (len(METHODS) + 1),
    ]
    for r in range(results["rounds"] + 1):
        cells = [fmt(*mean_interval([runs[m]["metric_by_round"][str(r)] for runs in seeds.values()]))
                 for m in METHODS]
        cells.append(fmt(*mean_interval([runs["smartfed"]["metric_by_round"][str(r)]
                                         - runs["fedavg-lora"]["metric_by_round"][str(r)] for runs in seeds.values()])))
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    for goal in results["targets"]:
        lines += ["", f"## Until {metric} {'≥' if higher else '≤'} {goal:.4g}", "",
                  "| | " + " | ".join(METHODS) + " | smartfed − fedavg-lora, paired |", "|---|---:|---:|---:|"]
        reached = {m: [reaching(runs[m], goal, higher) for runs in seeds.values()] for m in METHODS}
        for label, index, digits in (("rounds", 0, 1), ("uplink bytes per client", 1, 0)):
            cells = []
            for m in METHODS:
                hit = [v[index] for v in reached[m] if v[0] is not None]
                text = fmt(*mean_interval(hit), digits) if hit else "–"
                cells.append(f"{text} ({len(hit)}/{n} seeds reached it)")
            pairs = [s[index] - f[index] for s, f in zip(reached["smartfed"], reached["fedavg-lora"])
                     if s[0] is not None and f[0] is not None]
            cells.append(fmt(*mean_interval(pairs), digits) + f" (n = {len(pairs)})" if pairs else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## At equal uplink bytes", "",
              "SmartFed's metric after its last round whose cumulative uplink bytes per client are within "
              "FedAvg-LoRA's after round r (same seed), against FedAvg-LoRA's at round r:", "",
              "| FedAvg-LoRA round | bytes per client | fedavg-lora | smartfed (its round) | smartfed − fedavg-lora, "
              "paired |", "|---|---:|---:|---:|---:|"]
    for r in range(1, results["rounds"] + 1):
        pairs = [within_bytes(runs, r) for runs in seeds.values()]
        if any(p is None for p in pairs):
            break  # SmartFed's run ended before FedAvg-LoRA's bytes of round r
        budget = statistics.fmean(runs["fedavg-lora"]["cumulative_uplink_bytes"][str(r)] for runs in seeds.values())
        base = [runs["fedavg-lora"]["metric_by_round"][str(r)] for runs in seeds.values()]
        ours = [runs["smartfed"]["metric_by_round"][str(k)] for runs, k in zip(seeds.values(), pairs)]
        lines.append(f"| {r} | {budget:,.0f} | {fmt(*mean_interval(base))} | {fmt(*mean_interval(ours))} "
                     f"({', '.join(map(str, pairs))}) | {fmt(*mean_interval([a - b for a, b in zip(ours, base)]))} |")
    lines += ["", "![metric by round and by cumulative uplink bytes, every seed](onboarding.png)", "",
              "Uplink bytes per client and round: " + ", ".join(
                  f"{m} {statistics.fmean(runs[m]['uplink_bytes_per_client_round'] for runs in seeds.values()):,.0f}"
                  for m in METHODS) + ".", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for method, colour in zip(METHODS, ("tab:blue", "tab:orange")):
        for i, runs in enumerate(results["seeds"].values()):
            values, sent = runs[method]["metric_by_round"], runs[method]["cumulative_uplink_bytes"]
            rounds = sorted(values, key=int)
            label = method if i == 0 else None
            ax.plot([int(r) for r in rounds], [values[r] for r in rounds], color=colour, alpha=0.7, marker="o",
                    label=label)
            by_bytes.plot([sent.get(r, 0) / 1e6 for r in rounds], [values[r] for r in rounds], color=colour,
                          alpha=0.7, marker="o", label=label)
    for axis in (ax, by_bytes):
        for goal in results["targets"]:
            axis.axhline(goal, color="grey", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
        axis.legend()
    ax.set(xlabel="round", ylabel=results["metric"], title=f"{results['target']}: a new domain joins")
    ax.xaxis.get_major_locator().set_params(integer=True)
    by_bytes.set(xlabel="cumulative uplink MB per client", title="the same runs against the bytes each client sent")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


OVERRIDES = {"fedavg-lora": "fedavg_lora_overrides", "smartfed": "smartfed_overrides"}
PROTOCOL = ("model", "target", "target_data", "rounds", "clients", "steps", "lr", "pool_adapters", "metric",
            *OVERRIDES.values())


def merge(parts: list[dict]) -> dict:
    """One result from parts run at different times (seeds split over sessions): the same
    protocol, their seeds united (a later part's seed replaces an earlier one's)."""
    parts = [{key: "" for key in OVERRIDES.values()} | part for part in parts]  # parts from before the options: none
    first = parts[0]
    for part in parts[1:]:
        differ = [k for k in PROTOCOL if part.get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"onboarding --merge: the parts differ in {differ}; they are not one benchmark")
    seeds: dict[str, dict] = {}
    for part in parts:
        seeds.update(part["seeds"])
    merged = {**first, "seeds": dict(sorted(seeds.items(), key=lambda kv: int(kv[0])))}
    merged["command"] = "; ".join(dict.fromkeys(p["command"] for p in parts))
    merged["date"] = ", ".join(dict.fromkeys(p["date"] for p in parts))
    merged["wall_minutes"] = sum(p["wall_minutes"] for p in parts)
    explicit = [p["targets"] for p in parts if p.get("targets_given")]
    merged["targets"] = explicit[0] if explicit else default_targets(merged["seeds"], merged["rounds"])
    return merged


def overrides_of(part: dict, method: str) -> str:
    """The Hydra overrides a report ran ``method`` with (reports from before an option: none)."""
    return part.get(OVERRIDES[method]) or ""


def references(paths: list[str], protocol: dict, overrides: dict[str, str]) -> dict[str, dict[str, dict]]:
    """Results per seed and method from earlier reports (``--reference-from``) of this run's protocol:
    a method's result is taken where the report ran it with this run's overrides for it."""
    found: dict[str, dict[str, dict]] = {}
    for path in paths:
        try:
            part = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"onboarding --reference-from: {err}") from None
        differ = [k for k in protocol if part.get(k) != protocol[k]]
        if differ:
            raise SystemExit(f"onboarding --reference-from: {path} differs from this run in {differ} "
                             f"({', '.join(f'{k}={part.get(k)!r}, not {protocol.get(k)!r}' for k in differ)})")
        for method in METHODS:
            if overrides_of(part, method) == overrides[method]:
                for seed, runs in part["seeds"].items():
                    found.setdefault(seed, {})[method] = {**runs[method], "reused": True, "reference_report": str(path)}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_run_arguments(parser)
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds 42..42+N-1 (a random-init model, e.g. tiny-llama, is its seed: 1 only)")
    parser.add_argument("--seed-list", type=int, nargs="+", default=None, metavar="SEED",
                        help="these seeds instead of 42..42+N-1 (a benchmark in parts: one part per session)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="ONBOARDING_JSON",
                        help="no runs: one report (OUT) from the onboarding.json of parts of one benchmark")
    parser.add_argument("--targets", type=float, nargs="+", default=None,
                        help="metric values to reach (default: FedAvg-LoRA's mean metric halfway through; "
                             "with --merge: the merged report's)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "onboarding"))
    parser.add_argument("--runs-dir", default=None,
                        help="run folders (default: $POSTCARD_OUTPUTS or ./outputs, then bench-onboarding/)")
    parser.add_argument("--smartfed-overrides", default="",
                        help='Hydra overrides for the SmartFed runs only, e.g. "algorithm.importance=sensitivity" '
                             '(a variant on the same protocol; with --reuse-runs the FedAvg-LoRA runs are read)')
    parser.add_argument("--fedavg-lora-overrides", default="",
                        help='Hydra overrides for the FedAvg-LoRA runs only, e.g. "train.lr=3e-3" (a tuned baseline)')
    parser.add_argument("--reuse-runs", action="store_true",
                        help="read a completed run folder in RUNS_DIR of the same configuration (options added since at "
                             "their defaults) "
                             "instead of running it again (e.g. after an interrupted part)")
    parser.add_argument("--reference-from", nargs="+", default=None, metavar="ONBOARDING_JSON",
                        help="take a method's result for a seed from these earlier reports of the same protocol "
                             "(checked) where they ran it with this run's overrides for it, instead of running it "
                             "(e.g. a SmartFed variant against the FedAvg-LoRA runs of the docs' report)")
    argv = quick_argv(argv, "bench-onboarding-quick", ("--seeds", "1"))
    args, extra = parser.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]
    for name in ("rounds", "clients", "steps", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    start = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        try:
            parts = [json.loads(Path(p).read_text()) for p in args.merge]
        except (OSError, ValueError) as err:
            parser.error(f"--merge: {err}")
        merged = merge(parts)
        if args.targets:  # targets of the merged report's own
            merged["targets"], merged["targets_given"] = list(args.targets), True
        return write_outputs(out, "onboarding", merged, plot, report)
    runs_dir = Path(args.runs_dir or Path(os.environ.get("POSTCARD_OUTPUTS") or ROOT / "outputs") / "bench-onboarding")
    runs_dir = runs_dir.expanduser().resolve()
    common = [f"model={args.model}", f"output_dir={runs_dir}"]

    sources = [s for s in args.pool_sources.split(",") if s]
    pool_path = Path(args.pool).expanduser().resolve() if args.pool else runs_dir / f"pool-{args.model}"
    pool_cli.build(sources, [*common, "seed=42", f"rounds={args.pool_rounds}", f"train.local_steps={args.pool_steps}",
                             f"train.lr={args.lr}", f"eval.max_batches={args.eval_batches}"], pool=pool_path)
    run = [*common, f"task={args.task}", f"rounds={args.rounds}", f"num_clients={args.clients}",
           f"train.local_steps={args.steps}", f"train.lr={args.lr}", f"eval.max_batches={args.eval_batches}", *extra]
    target = compose(run)
    if target.model.get("random_init") and len(args.seed_list or range(args.seeds)) > 1:
        parser.error(f"model {args.model} is a random init drawn from the seed: the pool's adapters fit seed 42 "
                     "only (--seeds 1)")
    held = check_unseen(pool_path, target)
    smartfed = [f"algorithm.pool={pool_path}", f"algorithm.adapters=[{','.join(held)}]",
                *shlex.split(args.smartfed_overrides)]

    data = {k: list(v) for k, v in (("plays", target.task.get("plays")),
                                     ("categories", target.task.get("categories"))) if v}
    protocol = {"model": args.model, "target": args.task, "target_data": json.dumps(data), "rounds": args.rounds,
                "clients": args.clients, "steps": args.steps, "lr": args.lr, "pool_adapters": held}
    overrides = {"fedavg-lora": args.fedavg_lora_overrides, "smartfed": args.smartfed_overrides}
    reference = references(args.reference_from, protocol, overrides) if args.reference_from else {}
    per_method = {"fedavg-lora": shlex.split(args.fedavg_lora_overrides), "smartfed": smartfed}
    seeds: dict[str, dict] = {}
    for seed in args.seed_list or range(42, 42 + args.seeds):
        seeds[str(seed)] = {
            m: reference.get(str(seed), {}).get(m) or run_one(
                m, [*run, *per_method[m], f"seed={seed}", f"run_name=onboarding-{m}-s{seed}"], reuse=args.reuse_runs)
            for m in METHODS}
        for runs in seeds[str(seed)].values():
            runs.pop("smartfed_rounds", None)
    metric = next(iter(seeds.values()))["fedavg-lora"]["metric"]
    results = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/onboarding.py",
                                                      *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d %H:%M"), "wall_minutes": (time.time() - start) / 60,
        "model": args.model, "target": args.task, "target_data": json.dumps(data), "rounds": args.rounds,
        "clients": args.clients, "steps": args.steps, "lr": args.lr, "pool": str(pool_path), "pool_adapters": held,
        "metric": metric, "smartfed_overrides": args.smartfed_overrides,
        "fedavg_lora_overrides": args.fedavg_lora_overrides,
        "targets": args.targets or default_targets(seeds, args.rounds),
        "targets_given": bool(args.targets), "seeds": seeds,
    }
    return write_outputs(out, "onboarding", results, plot, report)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
