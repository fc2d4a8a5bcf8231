"""bench/flite.py's report: the runs grouped by (partition, method), their paired gaps to the reference
with 95% intervals, the verdict by the protocol's one rule (bench/protocol.py), the markdown report, the
tuning report and the plot."""

from __future__ import annotations

import time
from pathlib import Path

import protocol  # bench/protocol.py: the one rule for "met"
from flite_arms import BASES, REFERENCE, REPEATED, TASKS, TINY
from postcard.stats import mean_ci95


def grouped(results: dict) -> dict[tuple[str, str], list[dict]]:
    """(partition, method) -> its runs over seeds (a report of the old one-seed layout reads too)."""
    out: dict[tuple[str, str], list[dict]] = {}
    for run in results["runs"].values():
        out.setdefault((run["partition"], run["method"]), []).append(run)
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    import statistics

    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_gap(method_runs: list[dict], ref_runs: list[dict]) -> float:
    """Mean gap (pp) of the method to the reference run of the same seed (a one-seed method is
    compared with the reference's seed 0, not with its mean over seeds)."""
    ref = {r.get("seed", 0): r["final_accuracy"] for r in ref_runs}
    gaps = [100 * (r["final_accuracy"] - ref[r.get("seed", 0)]) for r in method_runs if r.get("seed", 0) in ref]
    return mean_std(gaps)[0] if gaps else float("nan")


def gap_interval(method_runs: list[dict], ref_runs: list[dict] | None) -> tuple[float, float, float] | None:
    """Mean gap (pp) of the method to the reference over paired seeds, and its 95% t-interval;
    ``ref_runs`` None: to the no-training arm, each run's own round 0 (θ_pre on the same items)."""
    if ref_runs is None:
        gaps = [100 * (r["final_accuracy"] - r["initial_accuracy"]) for r in method_runs]
    else:
        ref = {r.get("seed", 0): r["final_accuracy"] for r in ref_runs}
        gaps = [100 * (r["final_accuracy"] - ref[r.get("seed", 0)]) for r in method_runs if r.get("seed", 0) in ref]
    return mean_ci95(gaps) if len(gaps) > 1 else None


# ---------------------------------------------------------------------------- report
def verdict(gap: float, interval: tuple[float, float, float] | None, margin: float = -1.0,
            no_training: float | None = None) -> str:
    """Non-inferiority at ``margin`` pp by the protocol's one rule (``bench/protocol.py``): met only
    when the whole 95% interval lies above it; ``interval`` is (mean, low, high). ``no_training``:
    θ_pre's gap to the same reference on the same seeds — a "met" that θ_pre reaches too is
    uninformative."""
    result = protocol.verdict(gap, None if interval is None else interval[1:], margin, kind="non-inferiority",
                              no_training=no_training)
    if result == "not shown":
        return ("not shown: the point estimate is within the margin, the interval reaches "
                f"{interval[1]:+.1f} pp" if interval is not None else "not shown: one seed, the point estimate is within")
    if result == "uninformative":
        return (f"uninformative: θ_pre, not trained at all, is {no_training:+.1f} pp from the reference, "
                "within the margin too")
    return result


def theta_pre_gap(ref_runs: list[dict]) -> float:
    """θ_pre's gap (pp) to the reference, seed by seed: the reference run's round 0 − its final accuracy."""
    return mean_std([100 * (r["initial_accuracy"] - r["final_accuracy"]) for r in ref_runs])[0]


def fmt_bytes(value: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


def report(results: dict, command: str, machine: str) -> str:
    s = results["settings"]
    groups = grouped(results)
    task, base = TASKS[s.get("task", "cifar10")], s.get("base", "model")
    lines = [
        f"# FLITE vs full-weight and compressed-update baselines ({task}, MobileNetV2, {BASES[base]})",
        "",
        f"Made by `{command}` on {machine}, {results.get('date') or time.strftime('%Y-%m-%d')}.",
        f"{s['clients']} clients, {s['rounds']} rounds × {s['steps']} local steps of {s['batch_size']} images; " +
        (f"every arm over the protocol's evaluation seeds {results['protocol']['evaluation_seeds']}"
         if results.get("protocol") else f"{', '.join(REPEATED)} over the seeds counted in the table, the others "
         "seed 0") + "; accuracy over every client's held-out split after the last round (mean ± std over seeds).",
        "Uplink = payload bytes per client per round (the arrays' data); `count_bytes` = Flower's own count of "
        "the reply's records (arrays, metrics, keys); wire = the protobuf requests a SuperNode sends for the reply "
        "(`strategies.packing.wire_bytes`: metadata, object tree, one push per record/array/chunk, a reply of 8 or "
        "more arrays packed into one since 2026-12-05; – for runs made before it was recorded).",
        "",
    ]
    if results.get("base"):
        b = results["base"]
        lines += [f"θ_pre: {b['public_images']} public images ({100 * b['settings']['task']['public_fraction']:.0f}% "
                  f"of every class, disjoint from the clients'), {b['settings']['base']['steps']} steps; held-out "
                  f"public accuracy {b['accuracy_before']:.3f} → {b['accuracy_after']:.3f} ({b['seconds']:.0f} s); "
                  f"file sha256 {b.get('sha256', 'not recorded (a report made before 2026-12-04)')}.", ""]
    spec = results.get("protocol")
    if spec:
        arms = ", ".join(f"{name} lr {arm['best']['train.lr']:g} (grid {', '.join(f'{v:g}' for v in arm['grid']['train.lr'])})"
                         for name, arm in spec["arms"].items() if not arm.get("no_training"))
        lines += [f"Under the protocol `{spec['file']}` committed at {spec['commit'][:12]} before these runs: "
                  f"tuned on a validation split with seeds {spec['tuning_seeds']}, evaluated on seeds "
                  f"{spec['evaluation_seeds']}; {arms}; margin {spec['margin']:+g} pp ({spec['kind']}). Changes "
                  f"made after a result was seen: {'; '.join(spec.get('changes_after_results') or []) or 'none'}.", ""]
    verdicts = []
    margin = float(spec["margin"]) if spec else -1.0
    for partition in s["partitions"]:
        ref = groups.get((partition, REFERENCE))
        ref_bytes = ref[0]["uplink_bytes_per_client_round"] if ref else None
        label = "Dirichlet α=0.1" if partition == "dirichlet" else "IID"
        lines += [f"## {label}", "", "| method | lr | seeds | accuracy: round 0 → final | gain over round 0 (pp) | "
                  f"uplink B/client/round | count_bytes / wire | {REFERENCE} bytes ÷ method bytes | "
                  f"downlink B/client/round | Δ vs {REFERENCE}, same seeds (pp) | wall/run |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for method in s["methods"]:
            runs = groups.get((partition, method))
            if not runs:
                continue
            final, std = mean_std([r["final_accuracy"] for r in runs])
            initial = mean_std([r["initial_accuracy"] for r in runs])[0]
            gain = mean_std([100 * (r["final_accuracy"] - r["initial_accuracy"]) for r in runs])[0]
            sent = runs[0]["uplink_bytes_per_client_round"]
            ratio = f"{ref_bytes / sent:,.0f}×" if ref else "–"
            gap = f"{paired_gap(runs, ref):+.1f}" if ref else "–"
            spread = f" ± {std:.3f}" if len(runs) > 1 else ""
            framed = " / ".join(fmt_bytes(v) if v else "–" for v in (runs[0].get("uplink_message_bytes_per_client_round"),
                                                                      runs[0].get("uplink_wire_bytes_per_client_round")))
            lines.append(f"| {method} | {runs[0]['lr']:g} | {len(runs)} | {initial:.3f} → **{final:.3f}**{spread} "
                         f"| {gain:+.1f} | {sent:,.0f} ({fmt_bytes(sent)}) | {framed} | {ratio} "
                         f"| {fmt_bytes(runs[0]['downlink_bytes_per_client_round'])} | {gap} "
                         f"| {mean_std([r['seconds'] for r in runs])[0] / 60:.1f} min |")
        if ref:
            theta, theta_std = mean_std([r["initial_accuracy"] for r in ref])
            lines.append(f"| θ_pre (no training: round 0) | – | {len(ref)} | **{theta:.3f}**"
                         f"{f' ± {theta_std:.3f}' if len(ref) > 1 else ''} | +0.0 | 0 | – | – | – | "
                         f"{theta_pre_gap(ref):+.1f} | – |")
        lines.append("")
        label_gains = []
        for method in s["methods"]:
            runs = groups.get((partition, method))
            interval = gap_interval(runs, None) if runs else None
            if interval:
                label_gains.append(f"{method} {interval[0]:+.1f} pp ({interval[1]:+.1f} to {interval[2]:+.1f})")
        if label_gains:
            verdicts.append(f"- {label}: gain over θ_pre (no training), paired 95% intervals: "
                            + "; ".join(label_gains) + ".")
        for method in TINY:
            tiny = groups.get((partition, method))
            if not (ref and tiny):
                continue
            gap = paired_gap(tiny, ref)
            ratio = ref_bytes / tiny[0]["uplink_bytes_per_client_round"]
            interval = gap_interval(tiny, ref)
            paired = len({r.get("seed", 0) for r in tiny} & {r.get("seed", 0) for r in ref})
            ci = (f" (paired over {paired} seeds: 95% interval {interval[1]:+.1f} to "
                  f"{interval[2]:+.1f} pp)") if interval else " (one seed: no interval)"
            verdicts.append(f"- {label}: {method} is {gap:+.1f} pp from {REFERENCE}{ci} (target ≥ {margin:+g} pp: "
                            f"**{verdict(gap, interval, margin, theta_pre_gap(ref))}**) at {ratio:,.0f}× fewer uplink bytes "
                            f"(target ≥ 10,000×: **{'met' if ratio >= 10_000 else 'not met'}**).")
    if verdicts:
        lines += ["## Targets", "", *verdicts, ""]
    lines += ["![accuracy vs cumulative uplink bytes](flite.png)", ""]
    return "\n".join(lines)


def tuning_report(results: dict, draft: dict, refusal: str | None, command: str, draft_name: str = "protocol.json") -> str:
    lines = [f"# Tuning on the validation split ({TASKS[results['settings']['task']]}, {BASES[results['settings']['base']]})",
             "", f"Made by `{command}`, {time.strftime('%Y-%m-%d')}: mean validation accuracy over tuning seeds "
             f"{draft['tuning_seeds']} (task.eval_split=val: carved from the clients' training rows; no test item "
             "scored). **Bold**: each grid's best value (a protocol file takes those of its arms).", ""]
    for name, arm in draft["arms"].items():
        if arm.get("no_training"):
            continue
        cells = [f"**{acc:.4f}**" if float(v) == arm["best"]["train.lr"] else f"{acc:.4f}"
                 for v, acc in arm["validation_score"].items()]
        lines.append(f"- {name}: " + ", ".join(f"lr {v} → {c}" for v, c in zip(arm["validation_score"], cells)))
    by_partition: dict[str, list[float]] = {}
    for run in results["runs"].values():
        by_partition.setdefault(run["partition"], []).append(float(run["initial_accuracy"]))
    lines += ["", "θ_pre (no training, round 0) on the same validation items: " + "; ".join(
        f"{partition} {sum(v) / len(v):.4f}" for partition, v in by_partition.items()) + ".",
        "", f"protocol check of {draft_name}: **{'refused: ' + refusal if refusal else 'passes'}**", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedapps.comparison import draw_curves

    partitions = results["settings"]["partitions"]
    fig, axes = plt.subplots(1, len(partitions), figsize=(6.5 * len(partitions), 4.6), squeeze=False)
    for ax, partition in zip(axes[0], partitions):
        groups = grouped(results)
        curves = {m: min(groups[(partition, m)], key=lambda r: r.get("seed", 0))["curve"]
                  for m in results["settings"]["methods"] if (partition, m) in groups}
        label = "Dirichlet α=0.1" if partition == "dirichlet" else "IID"
        task = TASKS[results["settings"].get("task", "cifar10")]
        draw_curves(ax, curves, "accuracy", f"{task}, {label} (seed 0; hollow: round 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
