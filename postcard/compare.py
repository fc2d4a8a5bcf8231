"""``postcard compare REF RUN [RUN ...]``: finished runs, item by item, on the same held-out items.

    postcard compare outputs/<fedavg-lora run> outputs/<fednl run> outputs/<flite run> --out cmp/

Each run's final global model (``fedapps.final.load_run``) is scored on every client's
held-out items, one by one (kept in the run folder as ``items-<key>.npz``, one file per
scoring settings). The runs must score the same items (same task, partition, clients, seed
and evaluation settings): a pairing of different items is refused. The report gives, per run
(the mean's intervals and McNemar's test are ``postcard.stats``'):

* accuracy tasks (MMLU, NIAH, images): accuracy with its 95% Wilson interval; against the
  reference (the first run) the paired difference with its 95% interval (normal
  approximation over the per-item differences), McNemar's exact test (a two-sided
  binomial test on the discordant items) and a one-sided non-inferiority test at
  ``--margin`` (default 2 points: p < 0.05 says "not worse than the reference by 2 points");
* every task: the mean per-item loss (perplexity = exp of it for language modelling), the
  paired difference with its 95% t-interval and the paired t-test's p-value.

``compare.md`` and ``compare.json`` go to ``--out`` (default: a ``compare-<time>`` folder
beside the reference run). Exit status 2 on a bad folder or unpaired runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import numpy as np

from postcard.stats import Z95, mcnemar_p, mean_ci95, paired_ci95, standard_error


class CompareError(ValueError):
    pass


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default)."""
    if n <= 0:
        raise CompareError("no items to score")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(ref: np.ndarray, other: np.ndarray) -> dict:
    """McNemar's exact test on paired 0/1 outcomes: the discordant counts and the two-sided p-value
    of a binomial test of ``other right, ref wrong`` against ``ref right, other wrong`` at 1/2."""
    ref, other = np.asarray(ref) > 0.5, np.asarray(other) > 0.5
    gains, losses = int(np.sum(other & ~ref)), int(np.sum(ref & ~other))
    return {"other_right_ref_wrong": gains, "ref_right_other_wrong": losses, "p_value": mcnemar_p(gains, losses)}


def paired_interval(differences: np.ndarray, *, t: bool) -> tuple[float, float, float]:
    """(mean, low, high) of the mean of paired differences: a 95% t-interval, or the normal one
    (``postcard.stats.mean_ci95``)."""
    return mean_ci95(differences, normal=not t)


def noninferiority(differences: np.ndarray, margin: float) -> float:
    """One-sided p-value of the paired non-inferiority test: H0 "the mean paired difference is
    at most -margin" against "it is above" (normal approximation, as the accuracy interval).
    p < 0.05 says the compared run is not worse than the reference by ``margin`` or more."""
    from scipy.stats import norm

    d = np.asarray(differences, np.float64)
    if len(d) < 2:
        return float("nan")
    se = standard_error(d)
    shift = float(d.mean()) + float(margin)
    if se == 0.0:
        return 0.0 if shift > 0 else 1.0
    return float(norm.sf(shift / se))


def compare(items: dict[str, dict], reference: str, metric: str, margin: float = 0.02) -> dict:
    """The comparison of runs' per-item results (``{run name: FinalModel.items()}``) to ``reference``;
    for accuracy, ``margin`` is the non-inferiority margin (0.02 = 2 points)."""
    from scipy.stats import ttest_rel

    ref = items[reference]
    for name, result in items.items():
        if not (np.array_equal(result["client"], ref["client"]) and np.array_equal(result["index"], ref["index"])):
            raise CompareError(f"{name} was scored on other items than {reference}: the runs differ in task, "
                               "partition, clients, seed or evaluation settings, so they cannot be paired")
    out = {"reference": reference, "metric": metric, "items": int(len(ref["index"])), "margin": float(margin),
           "runs": {}}
    for name, result in items.items():
        row = {"mean_loss": float(np.mean(result["loss"]))}
        if metric == "perplexity":
            row["perplexity"] = math.exp(min(row["mean_loss"], 50.0))
        if "correct" in result:
            right = int(np.sum(result["correct"] > 0.5))
            row.update(accuracy=right / len(result["correct"]), accuracy_ci95=wilson(right, len(result["correct"])))
        if name != reference:
            mean, low, high = paired_ci95(result["loss"], ref["loss"])
            row["loss_diff"] = {"mean": mean, "ci95": (low, high),
                                "p_value": float(ttest_rel(result["loss"], ref["loss"]).pvalue)}
            if "correct" in result:
                mean, low, high = paired_ci95(result["correct"], ref["correct"], normal=True)
                row["accuracy_diff"] = {"mean": mean, "ci95": (low, high), **mcnemar_exact(ref["correct"],
                                                                                          result["correct"]),
                                        "noninferior_p": noninferiority(result["correct"] - ref["correct"], margin)}
        out["runs"][name] = row
    return out


def report(result: dict, runs: dict[str, Path], command: str) -> str:
    ref = result["reference"]
    lines = [f"# Paired comparison on {result['items']:,} held-out items (reference: {ref})", "",
             f"Command: `{command}`", ""]
    accuracy = "accuracy" in result["runs"][ref]
    if accuracy:
        margin = result.get("margin", 0.02)
        lines += [f"| run | accuracy (95% Wilson) | Δ vs reference (95% CI) | McNemar exact p (gains / losses) | "
                  f"non-inferiority p (margin {margin * 100:g} pp) | mean loss | Δ loss (95% CI), paired t p |",
                  "|---|---|---|---|---|---|---|"]
    else:
        lines += ["| run | perplexity | mean loss | Δ loss vs reference (95% CI) | paired t p |", "|---|---|---|---|---|"]
    for name, row in result["runs"].items():
        diff = row.get("loss_diff")
        loss_diff = f"{diff['mean']:+.4f} ({diff['ci95'][0]:+.4f}..{diff['ci95'][1]:+.4f})" if diff else "—"
        loss_p = f"{diff['p_value']:.3g}" if diff else "—"
        if accuracy:
            acc = row["accuracy_diff"] if "accuracy_diff" in row else None
            lines.append(
                f"| {name} | {row['accuracy']:.4f} ({row['accuracy_ci95'][0]:.4f}..{row['accuracy_ci95'][1]:.4f}) | "
                + (f"{acc['mean']:+.4f} ({acc['ci95'][0]:+.4f}..{acc['ci95'][1]:+.4f}) | {acc['p_value']:.3g} "
                   f"({acc['other_right_ref_wrong']} / {acc['ref_right_other_wrong']}) | "
                   f"{acc.get('noninferior_p', float('nan')):.3g} | " if acc else "— | — | — | ")
                + f"{row['mean_loss']:.4f} | {loss_diff}, p {loss_p} |")
        else:
            lines.append(f"| {name} | {row.get('perplexity', float('nan')):,.3f} | {row['mean_loss']:.4f} | "
                         f"{loss_diff} | {loss_p} |")
    lines += ["", "Runs:", *[f"- {name}: `{path}`" for name, path in runs.items()], ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="postcard compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="run folders; the first is the reference")
    p.add_argument("--out", type=Path, default=None, help="the report's folder")
    p.add_argument("--margin", type=float, default=0.02,
                   help="accuracy tasks: the non-inferiority margin, as a fraction (default 0.02 = 2 points)")
    args = p.parse_args(argv)
    from fedapps.final import load_run
    from fedapps.method import FinalStateError

    try:
        if len(args.runs) < 2:
            raise CompareError("give a reference run and at least one run to compare with it")
        names = {}
        for path in args.runs:
            name = path.resolve().name
            names[name if name not in names else str(path)] = path.resolve()
        items, metric = {}, None
        for name, path in names.items():
            final = load_run(path)
            metric = metric or str(final.cfg.task.metric)
            print(f"scoring {name} ...", flush=True)
            items[name] = final.items()
            del final
        if not 0 <= args.margin < 1:
            raise CompareError(f"--margin must be a fraction in [0, 1), got {args.margin}")
        result = compare(items, next(iter(names)), metric, margin=args.margin)
    except (CompareError, FinalStateError, ValueError) as err:
        print(f"postcard compare: {err}", file=sys.stderr)
        return 2
    out = args.out or (next(iter(names.values())).parent / f"compare-{dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    command = "postcard compare " + " ".join(str(p) for p in args.runs)
    (out / "compare.json").write_text(json.dumps({**result, "run_dirs": {k: str(v) for k, v in names.items()}},
                                                 indent=1) + "\n")
    text = report(result, names, command)
    (out / "compare.md").write_text(text)
    print(text)
    print(f"report: {out / 'compare.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
