"""The hostile-reply table of docs/robustness.md: every kind of tests/hostile.py × every strategy.

Each cell is what the server did with that reply (numpy level, a few seconds in all):
``R`` refused (state bit-identical to the honest-only aggregate), ``B`` accepted with the
documented bound applied, ``A`` accepted as harmless, ``–`` not applicable, ``FAIL`` a case
whose outcome broke its contract (the test suite fails on it too).

    .venv/bin/python bench/fuzz_table.py [--out docs/bench]   # also writes OUT/fuzz_table.md
                                                              # and the table in docs/robustness.md
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from hostile import KINDS, SPECS, run_case  # noqa: E402

CELL = {"refused": "R", "bounded": "B", "accepted": "A", "n/a": "–"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench",
                        help="folder for fuzz_table.md (default docs/bench)")
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # messages outside a Flower run

    header = "| group | kind | " + " | ".join(s.name for s in SPECS) + " | example reason |"
    lines = [header, "|" + "---|" * (len(SPECS) + 3)]
    totals = {"refused": 0, "bounded": 0, "accepted": 0, "n/a": 0, "FAIL": 0}
    for kind in KINDS:
        cells, reason = [], ""
        for spec in SPECS:
            try:
                result = run_case(spec, kind)
                outcome = result.outcome
                if outcome == "refused" and not reason:
                    reason = result.detail
            except Exception as err:  # noqa: BLE001 - a broken contract is reported, not hidden
                outcome, reason = "FAIL", f"{type(err).__name__}: {err}"[:120]
            totals[outcome] += 1
            cells.append(CELL.get(outcome, outcome))
        reason = reason.replace("|", "/")[:110]
        lines.append(f"| {kind.group} | {kind.name} | " + " | ".join(cells) + f" | {reason} |")
    cases = sum(totals.values()) - totals["n/a"]
    summary = (f"{len(KINDS)} kinds × {len(SPECS)} strategy configurations = {cases} applicable cases: "
               f"{totals['refused']} refused, {totals['bounded']} bounded, {totals['accepted']} accepted as "
               f"harmless, {totals['FAIL']} failed.")
    text = "\n".join([summary, "", *lines]) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fuzz_table.md").write_text(
        "<!-- written by `.venv/bin/python bench/fuzz_table.py` -->\n" + text)
    docs = ROOT / "docs" / "robustness.md"
    start, end = "<!-- fuzz-table:start -->", "<!-- fuzz-table:end -->"
    page = docs.read_text()
    if start in page and end in page:
        head, rest = page.split(start, 1)
        docs.write_text(head + start + "\n" + text + rest[rest.index(end):])
    if totals["FAIL"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
