"""The evidence protocol every comparison in bench/ follows (docs/benchmarks.md, "Protocol").

One rule for "met", and the checks a protocol file must pass before its evaluation runs:

* :func:`verdict` — superiority or non-inferiority judged by the 95% interval's bound against a
  margin stated in advance: ``met`` only when the whole interval clears the margin, ``not met``
  when the point estimate does not, ``not shown`` in between (the same function for every method).
  Given the no-training arm's difference to the same baseline, a ``met`` that not training would
  reach as well (its point estimate clears the same bound) is ``uninformative``: the comparison
  cannot tell the method from not training at all.
* :func:`check` — a protocol (a JSON file committed before the evaluation runs) is refused when
  its tuning and evaluation seeds overlap, when an arm's best value sits at the edge of its grid
  (the grid does not bracket it: extend it), when the arms' tuning budgets differ, or when it has
  no no-training arm (round 0 / θ_pre).
* :func:`best_on_grid` — an arm's best value: the middle of the values whose validation score lies
  within a stated tolerance of the best (0: exact ties), so an arm at its metric's ceiling at every
  value (a plateau over the whole grid) gets an inner value rather than an edge.

    .venv/bin/python bench/protocol.py check PROTOCOL.json   # exit 0, or 2 with one line saying why

A protocol file::

    {"tuning_seeds": [100, 101], "evaluation_seeds": [0, 1, 2, 3, 4],
     "split": "validation",                      # where the grids were scored: never "test"
     "margin": -1.0, "kind": "non-inferiority",  # stated before the evaluation
     "arms": {"flite-int4": {"grid": {"train.lr": [1e-3, 3e-3, 1e-2]}, "best": {"train.lr": 3e-3}},
              "fedavg-full": {"grid": {"train.lr": [3e-5, 1e-4, 3e-4]}, "best": {"train.lr": 1e-4}},
              "theta-pre": {"no_training": true}},
     "changes_after_results": ["..."]}           # every change made after a result was seen
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

KINDS = ("non-inferiority", "superiority")


class ProtocolError(ValueError):
    """A protocol or report that a skeptical reviewer would reject (says why, in one line)."""


def verdict(estimate: float, interval: Sequence[float] | None, margin: float, *, kind: str = "non-inferiority",
            higher_is_better: bool = True, no_training: float | None = None) -> str:
    """``met`` / ``not shown`` / ``not met`` for a difference (method − baseline) with its 95%
    interval ``(low, high)``. Non-inferiority: the difference must be shown above ``margin`` (a
    negative number for "at most this much worse"); superiority: above ``max(margin, 0)``.
    ``higher_is_better=False`` (perplexity, loss): the difference and its interval are read with
    the sign flipped. Met only when the interval's bound clears the margin; one estimate alone
    (``interval`` None) is never met.

    ``no_training``: the no-training arm's difference to the same baseline (θ_pre or round 0 −
    baseline, on the same items). When its point estimate clears the bound too, a ``met`` is
    ``uninformative`` — not training would pass the same test, so passing it says nothing about
    the method (a reference that barely improves on its starting point leaves no room to fail)."""
    if kind not in KINDS:
        raise ProtocolError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if not math.isfinite(float(estimate)):
        raise ProtocolError(f"the estimate must be a finite number, got {estimate!r}")
    if no_training is not None and not math.isfinite(float(no_training)):
        raise ProtocolError(f"the no-training arm's difference must be a finite number, got {no_training!r}")
    sign = 1.0 if higher_is_better else -1.0
    bound = float(margin) if kind == "non-inferiority" else max(float(margin), 0.0)

    def clears(value: float) -> bool:  # non-inferiority: at the margin counts; superiority: strictly above
        return value >= bound if kind == "non-inferiority" else value > bound

    if interval is not None and clears(min(sign * float(v) for v in interval[:2])):
        return "uninformative" if no_training is not None and clears(sign * float(no_training)) else "met"
    return "not shown" if clears(sign * float(estimate)) else "not met"


def _budget(grid: Mapping[str, Sequence]) -> int:
    return math.prod(len(v) for v in grid.values()) if grid else 0


def check(protocol: Mapping) -> None:
    """Refuse (ProtocolError, one line) a protocol a reviewer would reject; see the module docstring."""
    tuning = {int(s) for s in protocol.get("tuning_seeds") or []}
    evaluation = {int(s) for s in protocol.get("evaluation_seeds") or []}
    if not evaluation:
        raise ProtocolError("no evaluation seeds")
    if tuning & evaluation:
        raise ProtocolError(f"tuning and evaluation seeds overlap: {sorted(tuning & evaluation)} (tune on other seeds)")
    if str(protocol.get("split", "validation")) == "test":
        raise ProtocolError("the grids were scored on the test split: tune on a validation split")
    if protocol.get("kind", "non-inferiority") not in KINDS:
        raise ProtocolError(f"kind must be one of {list(KINDS)}, got {protocol.get('kind')!r}")
    if not isinstance(protocol.get("margin"), (int, float)):
        raise ProtocolError("no margin stated in advance")
    arms = protocol.get("arms") or {}
    if not any(bool(arm.get("no_training")) for arm in arms.values()):
        raise ProtocolError("no no-training arm (round 0 / θ_pre): every table needs one")
    budgets = {}
    for name, arm in arms.items():
        if arm.get("no_training"):
            continue
        check_arm(name, arm)
        budgets[name] = _budget(arm.get("grid") or {})
    if len(set(budgets.values())) > 1:
        raise ProtocolError(f"the arms' tuning budgets differ: {budgets} grid points (give every arm the same)")


def check_arm(name: str, arm: Mapping) -> None:
    """Refuse (ProtocolError) an arm whose best value is missing, off its grid or at the grid's edge."""
    grid, best = arm.get("grid") or {}, arm.get("best") or {}
    for key, values in grid.items():
        values = sorted(float(v) for v in values)
        if key not in best:
            raise ProtocolError(f"arm '{name}': no best value of {key}")
        if float(best[key]) not in values:
            raise ProtocolError(f"arm '{name}': its best {key} = {best[key]} is not on its grid {values}")
        if len(values) < 3 or float(best[key]) in (values[0], values[-1]):
            raise ProtocolError(f"arm '{name}': its best {key} = {best[key]} sits at the edge of {values}: "
                                "extend the grid until the best value is inside it")


def tied_best(scores: Mapping[float, Sequence[float]], *, higher_is_better: bool = True,
              tolerance: float = 0.0) -> list[float]:
    """The grid values (ascending) whose mean validation score over the tuning seeds is within ``tolerance``
    of the best mean (``scores``: value -> one score per tuning seed; ``tolerance`` 0: exact ties only).
    Refuses a grid where a value lacks a seed the others have."""
    if not scores:
        raise ProtocolError("no tuning runs")
    counts = {value: len(s) for value, s in scores.items()}
    if len(set(counts.values())) > 1:
        raise ProtocolError(f"unequal tuning runs per grid value: {counts} (run every value on every tuning seed)")
    if not tolerance >= 0:
        raise ProtocolError(f"the tie tolerance must be >= 0, got {tolerance!r}")
    sign = 1.0 if higher_is_better else -1.0
    means = {value: sign * sum(s) / len(s) for value, s in scores.items()}
    top = max(means.values())
    return sorted(value for value, mean in means.items() if mean >= top - tolerance)


def best_on_grid(scores: Mapping[float, Sequence[float]], *, higher_is_better: bool = True,
                 tolerance: float = 0.0) -> float:
    """The best grid value: the middle of :func:`tied_best`'s values (the lower middle of an even count),
    so a plateau of ties that spans the grid picks an inner value, and one that touches an edge picks a
    value :func:`check` refuses when it is that edge."""
    tied = tied_best(scores, higher_is_better=higher_is_better, tolerance=tolerance)
    return tied[(len(tied) - 1) // 2]


def arm_entry(scores: Mapping[float, Sequence[float]], key: str, *, higher_is_better: bool = True,
              tolerance: float = 0.0) -> dict:
    """One arm of a protocol file from its tuning runs (grid value -> a validation score per tuning seed):
    its grid, its best value (:func:`best_on_grid`), the values tied with it within ``tolerance`` and the
    mean validation score of every value."""
    tied = tied_best(scores, higher_is_better=higher_is_better, tolerance=tolerance)
    best = best_on_grid(scores, higher_is_better=higher_is_better, tolerance=tolerance)
    entry = {"grid": {key: sorted(float(v) for v in scores)}, "best": {key: best},
             "validation_score": {f"{v:g}": round(sum(s) / len(s), 4) for v, s in sorted(scores.items())}}
    if tolerance:
        entry["tied_within"] = {"tolerance": tolerance, key: tied}
    return entry


def commands_of(results: Mapping) -> list[str]:
    """Every call that added runs to a tuning or an evaluation file, in order (a grid extended or a part
    resumed is another call); files of one call record only ``command``."""
    return list(results.get("commands") or [c for c in [results.get("command")] if c])


def committed(path: Path) -> str:
    """The commit that last changed ``path``, refused when the file is not committed as it is now (an
    evaluation runs only under a protocol fixed in git beforehand, and its report names this commit)."""
    import subprocess

    path = Path(path).resolve()
    git = ["git", "-C", str(path.parent)]
    try:
        dirty = subprocess.run([*git, "status", "--porcelain", "--", path.name], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        raise ProtocolError(f"{path} is not in a git repository ({err}): commit the protocol before the "
                            "evaluation runs") from None
    commit = subprocess.run([*git, "log", "-1", "--format=%H", "--", path.name], capture_output=True,
                            text=True).stdout.strip()  # a repository without commits fails: not committed
    if dirty or not commit:
        raise ProtocolError(f"{path} is not committed as it is now: commit the protocol before the evaluation runs")
    return commit


def load(path: Path) -> tuple[dict, str]:
    """A protocol file an evaluation may run under: read, :func:`check`-ed and :func:`committed`;
    returns (the protocol, its commit), or raises ProtocolError saying why not."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProtocolError(f"cannot read {path}: {err}") from None
    check(spec)
    return spec, committed(path)


def write_draft(spec: Mapping, path: Path) -> str | None:
    """Write a drafted protocol to ``path`` and return why :func:`check` refuses it (None: it passes)."""
    Path(path).write_text(json.dumps(spec, indent=1) + "\n")
    try:
        check(spec)
    except ProtocolError as err:
        return str(err)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check a protocol file before its evaluation runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    checking = sub.add_parser("check", help="refuse (exit 2, one line) a protocol a reviewer would reject")
    checking.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    try:
        check(json.loads(args.file.read_text()))
    except (OSError, json.JSONDecodeError) as err:
        print(f"protocol: cannot read {args.file}: {err}", file=sys.stderr)
        return 2
    except ProtocolError as err:
        print(f"protocol: refused: {err}", file=sys.stderr)
        return 2
    print(f"protocol: {args.file} passes (tuning and evaluation seeds disjoint, grids bracket their best values, "
          "equal budgets, a no-training arm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
