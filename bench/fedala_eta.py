"""FedALA's step size η chosen on the validation split, and whether its learned weights move (issue #43).

    .venv/bin/python bench/fedala_eta.py --out docs/bench/fedala-eta      # SmolLM2, Shakespeare (~25 min a value)
    .venv/bin/python bench/fedala_eta.py --quick                          # the tiny Llama, 2 rounds (minutes)

FedALA (``algorithm=fedala``) learns, on each client, element-wise weights w ∈ [0, 1] that say how
much of the new global adapter to take in (``w ← clip(w − η·∂L/∂θ·(global − local), 0, 1)``). With
the original's η = 1 the weights never moved in the MMLU comparison (mean 0.99999 after every
round: docs/fednl.md), so FedALA was FedAvg-LoRA there. Here every η of ``--eta-grid`` trains on
``task.eval_split=val`` (validation windows carved from the clients' training data; the test
windows untouched) with the tuning seeds, and the report gives, per η, the validation metric after
the last round, FedALA's gain over its round 0, and the clients' weights after each round's ALA
(min / mean / max over clients and elements: ``eval_ala-weight-*`` in metrics.jsonl). The best η
is taken by ``protocol.best_on_grid`` (the middle of values within ``--tie-tolerance`` of the best)
and refused at an edge of the grid (``protocol.arm_entry``): extend the grid with another call to
the same ``--out`` (finished runs are kept). Extra Hydra overrides after ``--`` apply to every run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import protocol  # noqa: E402  bench/protocol.py
from smartfed import run_one  # noqa: E402  bench/smartfed.py: one simulation, reused when finished

KEY = "algorithm.ala.eta"
QUICK = ("--model", "tiny-llama", "--rounds", "2", "--steps", "2", "--eta-grid", "1,100,10000",
         "--runs-dir", str(ROOT / "outputs" / "bench-fedala-eta-quick"), "algorithm.ala.max_start_epochs=2")
WEIGHTS = ("min", "mean", "max")


def log(message: str) -> None:
    print(f"[fedala-eta {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", default="shakespeare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="local steps per client per round")
    p.add_argument("--lr", type=float, default=1e-3, help="the LoRA learning rate (train.lr), the same for every η")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--eta-grid", default="1,10,100,1000", help="comma-separated values of algorithm.ala.eta")
    p.add_argument("--seed-list", type=int, nargs="+", default=[100], metavar="SEED", help="the tuning seeds")
    p.add_argument("--tie-tolerance", type=float, default=0.0,
                   help="validation metrics within this of the best tie (their middle value is taken)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "fedala-eta")
    p.add_argument("--runs-dir", type=Path, default=None, help="run folders (default: outputs/bench-fedala-eta)")
    p.add_argument("--quick", action="store_true", help=f"a check in minutes: {' '.join(QUICK)} (the report under "
                   "outputs/fedala-eta-quick unless --out is given; later options still apply)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv:  # the user's own options after these win
        argv = [*QUICK, *([] if any(a.split("=")[0] == "--out" for a in argv) else
                          ["--out", str(ROOT / "outputs" / "fedala-eta-quick")]), *argv]
    args, extra = p.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") and a != "--"]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [a for a in extra if a != "--"]
    try:
        args.grid = sorted({float(v) for v in args.eta_grid.split(",") if v.strip()})
    except ValueError:
        p.error(f"--eta-grid must be comma-separated numbers, got {args.eta_grid!r}")
    if len(args.grid) < 3 or min(args.grid) <= 0:
        p.error("--eta-grid needs at least three positive values (a best value must be bracketed)")
    return args


def one(args, eta: float, seed: int) -> dict:
    from fedapps.fedala import ala_weights_by_round
    from fedapps.outputs import read_metrics

    runs_dir = (args.runs_dir or ROOT / "outputs" / "bench-fedala-eta").expanduser().resolve()
    items = [f"model={args.model}", f"task={args.task}", f"rounds={args.rounds}", f"num_clients={args.clients}",
             f"train.local_steps={args.steps}", f"train.lr={args.lr}", f"eval.max_batches={args.eval_batches}",
             f"output_dir={runs_dir}", *args.overrides, f"{KEY}={eta}", f"seed={seed}", "task.eval_split=val",
             f"run_name=fedala-eta{eta:g}_s{seed}"]
    summary = run_one("fedala", items, reuse=True)
    if summary.get("status") != "completed":
        raise SystemExit(f"the run at η={eta:g}, seed {seed} did not complete ({summary.get('status')}): "
                         f"{summary.get('run_dir')}")
    return {"eta": eta, "seed": seed, "metric": summary["metric"], "initial_metric": summary["initial_metric"],
            "final_metric": summary["final_metric"], "weights": ala_weights_by_round(read_metrics(summary["run_dir"])),
            "run_dir": summary["run_dir"]}


def report(results: dict) -> str:
    runs, entry = results["runs"], results["best"]
    metric = runs[0]["metric"]
    lines = [f"# FedALA's η on the validation split ({results['settings']['model']}, {results['settings']['task']})",
             "", "Made by " + "; then ".join(f"`{c}`" for c in protocol.commands_of(results))
             + f", {results['date']} (each call ran the values it lacked). Tuning seeds {results['settings']['seeds']}; "
             f"{results['settings']['rounds']} rounds × {results['settings']['steps']} local steps, "
             f"{results['settings']['clients']} clients, LoRA lr {results['settings']['lr']:g}; validation "
             f"{metric} of the clients' ALA'd models after the last round "
             f"({'lower' if metric == 'perplexity' else 'higher'} is better).", "",
             f"| η | {metric}: round 0 → final | gain over round 0 | ALA weights after the last round: min / mean / max "
             "| weights' range over the run |", "|---:|---:|---:|---:|---:|"]
    for eta in sorted({r["eta"] for r in runs}):
        mine = [r for r in runs if r["eta"] == eta]
        start = statistics.fmean(r["initial_metric"] for r in mine)
        final = statistics.fmean(r["final_metric"] for r in mine)
        last = [r["weights"][-1] for r in mine if r["weights"]]
        lo = min((w["min"] for r in mine for w in r["weights"]), default=float("nan"))
        hi = max((w["max"] for r in mine for w in r["weights"]), default=float("nan"))
        shown = (" / ".join(f"{statistics.fmean(w[k] for w in last):.4f}" for k in WEIGHTS) if last else "–")
        mark = "**" if eta == entry.get("best", {}).get(KEY) else ""
        lines.append(f"| {mark}{eta:g}{mark} | {start:.2f} → {mark}{final:.2f}{mark} | {final - start:+.2f} | {shown} "
                     f"| {lo:.4f} to {hi:.4f} |")
    refusal = results.get("refused")
    lines += ["", (f"Best η: **{entry['best'][KEY]:g}** (validation {metric} "
                   f"{entry['validation_score'][format(entry['best'][KEY], 'g')]:.2f}"
                   f"{'; tied within ' + str(entry['tied_within']) if entry.get('tied_within') else ''}); "
                   + ("**refused**: " + refusal if refusal else "inside the grid: it may be used under a protocol"))
              if entry.get("best") else f"No best η: {refusal}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in ["bench/fedala_eta.py", *(sys.argv[1:] if argv is None else argv)])
    path = args.out / "tuning.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    runs = earlier.get("runs", [])
    done = {(float(r["eta"]), int(r["seed"])) for r in runs}
    jobs = [(eta, seed) for eta in args.grid for seed in args.seed_list if (eta, seed) not in done]
    commands = protocol.commands_of(earlier) + ([command] if jobs else [])
    settings = {"model": args.model, "task": args.task, "rounds": args.rounds, "clients": args.clients,
                "steps": args.steps, "lr": args.lr, "seeds": args.seed_list, "overrides": args.overrides}
    for i, (eta, seed) in enumerate(jobs, 1):
        log(f"[{i}/{len(jobs)}] η={eta:g}, seed {seed} (validation split)")
        runs.append(one(args, eta, seed))
        path.write_text(json.dumps({"runs": runs, "settings": settings, "command": command, "commands": commands},
                                   indent=1) + "\n")
    scores: dict[float, list[float]] = {}
    for r in runs:
        scores.setdefault(float(r["eta"]), []).append(float(r["final_metric"]))
    higher = runs[0]["metric"] != "perplexity"
    entry = protocol.arm_entry(scores, KEY, higher_is_better=higher, tolerance=args.tie_tolerance)
    refusal = None
    try:
        protocol.check_arm("fedala", entry)
    except protocol.ProtocolError as err:
        refusal = str(err)
    results = {"command": command, "commands": commands or [command], "date": time.strftime("%Y-%m-%d"),
               "settings": settings, "runs": runs, "best": entry, "refused": refusal}
    path.write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    (args.out / "tuning.md").write_text(text)
    print(text)
    log(f"report: {args.out / 'tuning.md'}" + (f" (refused: {refusal})" if refusal else ""))
    return 2 if refusal else 0


if __name__ == "__main__":
    sys.exit(main())
