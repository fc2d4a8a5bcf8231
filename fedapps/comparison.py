"""Comparing finished runs: the table (``comparison.csv`` / ``.md``), the runs' labels by what was swept,
and the curves of metric against bytes sent (``comparison.png``). ``postcard compare`` and ``make demo``
write them; :mod:`fedapps.outputs` is one run's folder.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fedapps.outputs import cumulative_curve, fmt

COLUMNS = ("algorithm", "task", "model", "partition", "rounds", "num_clients", "metric",
           "initial_metric", "final_metric", "uplink_bytes_per_client_round",
           "downlink_bytes_per_client_round", "wall_seconds", "run_dir")


# config keys that name a run rather than an experiment: never "swept"
_NOT_SWEPT = ("output_dir", "run_name", "resume")


def _leaves(tree, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, name + "."))
        else:
            out[name] = value
    return out


def swept_keys(summaries: list[dict]) -> list[str]:
    """The config keys whose values differ between the runs (what a sweep varied), beyond the
    group names already shown (a group's own keys change with it, so they are left out then)."""
    leaves = [_leaves(s.get("config")) for s in summaries]
    if len(leaves) < 2:
        return []
    keys = sorted(set().union(*leaves))
    differ = [k for k in keys if len({json.dumps(leaf.get(k), sort_keys=True, default=str) for leaf in leaves}) > 1]
    groups = {"algorithm", "task", "model", "partition"}
    changed_groups = {g for g in groups if len({s.get(g) for s in summaries}) > 1}
    return [k for k in differ if k.split(".")[0] not in changed_groups and k not in _NOT_SWEPT
            and not k.endswith(".name")]


def run_label(summary: dict, swept: list[str]) -> str:
    """A run's name in a comparison: its algorithm and the swept values (``fedprox train.lr=0.001``)."""
    leaves = _leaves(summary.get("config"))
    return " ".join([str(summary.get("algorithm"))] + [f"{k}={leaves.get(k)}" for k in swept])


def comparison_rows(summaries: list[dict]) -> list[dict]:
    """One row per run: the COLUMNS, then a column per swept config key (:func:`swept_keys`)."""
    swept = swept_keys(summaries)
    rows = []
    for s in summaries:
        leaves = _leaves(s.get("config"))
        rows.append({**{k: s.get(k) for k in COLUMNS}, **{k: leaves.get(k) for k in swept}})
    from fedapps.registry import METHODS

    reference = {name for name, method in METHODS.items() if method.reference}  # the plain LoRA baseline
    base = next((r["uplink_bytes_per_client_round"] for r in rows if r["algorithm"] in reference), None)
    for row in rows:
        up = row["uplink_bytes_per_client_round"]
        # six significant digits, not decimals: 648 / 9,768,960 kept as 6.63331e-05, so its inverse reads 15,076
        row["uplink_vs_fedavg_lora"] = float(f"{up / base:.6g}") if base and up else None
    return rows


def write_comparison(summaries: list[dict], folder: Path) -> Path:
    """comparison.md, comparison.csv (one row per run, a column per swept key) and comparison.png
    (one curve per run)."""
    rows = comparison_rows(summaries)
    swept = swept_keys(summaries)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "comparison.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shown = ["algorithm", *swept, "task", "model", "partition", "metric", "initial_metric", "final_metric",
             "uplink_bytes_per_client_round", "uplink_vs_fedavg_lora", "wall_seconds"]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        cells = {k: fmt(row[k]) for k in shown}
        ratio = row["uplink_vs_fedavg_lora"]
        if ratio and ratio < 1:
            cells["uplink_vs_fedavg_lora"] = f"{ratio:.3g} ({1 / ratio:,.0f}× fewer)"
        lines.append("| " + " | ".join(cells[k] for k in shown) + " |")
    (folder / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot_comparison(summaries, folder / "comparison.png")
        plotted = ", comparison.png"
    except Exception as err:  # a plot must never lose the table
        plotted = f" (plot skipped: {err})"
    print(f"\ncomparison written to {folder / 'comparison.md'}, comparison.csv{plotted}")
    return folder / "comparison.md"


def comparison_curves(summaries: list[dict], metric: str) -> dict[str, list]:
    """One (round, metric, cumulative bytes) curve per run, labelled by :func:`run_label`
    (runs with equal labels, e.g. repeats of one config, are numbered)."""
    swept = swept_keys(summaries)
    labels = [run_label(s, swept) for s in summaries]
    curves, seen = {}, {}
    for summary, label in zip(summaries, labels):
        if labels.count(label) > 1:
            seen[label] = seen.get(label, 0) + 1
            label = f"{label} #{seen[label]}"
        curves[label] = cumulative_curve(summary["run_dir"], metric)
    return curves


def plot_comparison(summaries: list[dict], path: Path) -> None:
    """Each run's metric against the uplink bytes one client has sent so far (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sorted({s["metric"] for s in summaries})
    fig, axes = plt.subplots(1, len(metrics), figsize=(7 * len(metrics), 4.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        curves = comparison_curves([s for s in summaries if s["metric"] == metric], metric)
        draw_curves(ax, curves, metric, f"{metric} vs bytes sent (hollow: round 0, before any upload)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_curves(ax, curves: dict[str, list], metric: str, title: str) -> None:
    """On ``ax``: each label's (round, metric, cumulative bytes) curve, log x; round 0 hollow."""
    for label, curve in curves.items():
        start = [m for _, m, b in curve if b == 0][:1]
        xs = [b for _, _, b in curve if b > 0]
        ys = [m for _, m, b in curve if b > 0]
        if not xs:
            continue
        line, = ax.plot(xs, ys, marker="o", ms=4, label=label)
        if start:  # round 0 (nothing sent yet) drawn at the first round's x, hollow
            ax.plot([xs[0]], start, marker="o", mfc="none", color=line.get_color())
    ax.set_xscale("log")
    ax.set(xlabel="cumulative uplink bytes per client", ylabel=metric, title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
