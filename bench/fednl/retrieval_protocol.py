"""FedNL's passkey comparison (issue #44, item 4) under the evidence protocol (``bench/protocol.py``).

    # 1. tune: every arm's learning rate over a grid of the same size, on the validation prompts, with
    #    tuning seeds only; scored by the answer's cross-entropy (lower is better: exact match ties at
    #    20/20 for full attention); the bench.fednl arguments after -- are the training settings
    python -m bench.fednl.retrieval_protocol tune --lr-grid fednl=1e-4,3e-4,1e-3 \\
        --lr-grid fednl-ablate=1e-4,3e-4,1e-3 --lr-grid fedavg-lora=1e-4,3e-4,1e-3 --tuning-seeds 100 \\
        --evaluation-seeds 0 1 2 --lengths 512,1024 --prompts 200 --out docs/bench/fednl/retrieval-protocol \\
        --runs outputs/bench-fednl-retrieval-tune --draft protocol.json -- --retrieval-rounds 6 \\
        --passkey-lengths 512 --passkey-prompts 20 --threads 2 --fednl-overrides "..."
    # 2. commit the drafted protocol (it passes bench/protocol.py's check), then evaluate under it:
    python -m bench.fednl.retrieval_protocol evaluate docs/bench/fednl/retrieval-protocol/protocol.json \\
        --out docs/bench/fednl/retrieval-protocol/test --runs outputs/bench-fednl-retrieval-eval

``tune`` is resumable (a value already scored on a seed is kept; a later call may extend a grid, every
call is recorded in ``tuning.json``) and drafts the protocol: each arm's grid and best value, the
tuning and evaluation seeds, the no-training arm (FedNL at init, ``fednl:round0``), the target stated in
advance (FedNL − its ablation ≥ +20 pp, p < 0.01, and at least half of the ablation → full-attention gap
recovered), and the training settings. ``evaluate`` refuses a protocol that fails the check or is not
committed as it is, runs every arm at its best learning rate on the test prompts of every evaluation seed
(resumable), and writes ``retrieval.md`` / ``retrieval.json``: the section's tables, the protocol's
commit, and the verdict by ``bench.protocol.verdict`` on the pooled paired difference's 95% interval.
The evaluation runs also measure the aggregation drop (``--local-prompts`` of ``tune``, kept in the
protocol; bench.fednl's ``--retrieval-local-prompts``): each client's last local model against the
final global model on the client's own first held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from .retrieval import (ALGORITHMS, ROUND0, TARGET_GAIN, TARGET_P, TARGET_SHARE, read_record, record_path,
                        retrieval_lines, section_retrieval, write_record)
from .runs import log, spec_key

ARMS = {spec_key(spec): spec for spec in ALGORITHMS}  # fednl, fednl-ablate, fedavg-lora
MANAGED = ("--sections", "--retrieval-algorithms", "--retrieval-seeds", "--retrieval-split", "--lr", "--out",
           "--retrieval-resume", "--retrieval-keep",
           "--retrieval-local-prompts")  # set by this tool, never in the training settings


def bench_args(extra: list[str], *, algorithms: list[str], seeds: list[int], split: str, out: Path, lengths=None,
               prompts=None, local_prompts=0, keep: Path | None = None):
    """bench.fednl's parsed arguments for one call of the retrieval section."""
    from .cli import parse_args

    argv = [*extra, "--sections", "retrieval", "--retrieval-algorithms", ",".join(algorithms),
            "--retrieval-seeds", ",".join(str(s) for s in seeds), "--retrieval-split", split, "--out", str(out)]
    if lengths:
        argv += ["--passkey-lengths", str(lengths)]
    if prompts:
        argv += ["--passkey-prompts", str(prompts)]
    if local_prompts:
        argv += ["--retrieval-local-prompts", str(local_prompts)]
    if out.is_dir():
        argv += ["--retrieval-resume", str(out)]
    if keep is not None:
        argv += ["--retrieval-keep", str(keep)]
    return parse_args(argv)


def _grid(values: list[str]) -> dict[str, list[float]]:
    grids = {}
    for item in values:
        arm, _, numbers = item.partition("=")
        if arm not in ARMS:
            raise SystemExit(f"--lr-grid: arm must be one of {list(ARMS)}, got {arm!r}")
        try:
            grids[arm] = sorted({float(v) for v in numbers.split(",") if v})
        except ValueError:
            raise SystemExit(f"--lr-grid {item!r}: comma list of numbers") from None
    return grids


def answer_ce(run: dict) -> float:
    """A scored run's mean answer cross-entropy over every prompt (``retrieval_items.npz``)."""
    import numpy as np

    with np.load(Path(run["run_dir"]) / "retrieval_items.npz") as items:
        return float(np.mean(items["loss"]))


def tune(args, extra: list[str]) -> int:
    from bench import protocol

    grids = _grid(args.lr_grid)
    if set(grids) != set(ARMS):
        raise SystemExit(f"--lr-grid: give every arm a grid ({list(ARMS)}), got {sorted(grids)}")
    if set(args.tuning_seeds) & set(args.evaluation_seeds):
        raise SystemExit("tuning and evaluation seeds overlap: tune on other seeds")
    if any(flag in extra for flag in MANAGED):
        raise SystemExit(f"after --: training settings only; this tool sets {list(MANAGED)}")
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "tuning.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"calls": [], "scores": {}}
    if record.get("bench_args", extra) != extra:
        raise SystemExit(f"{record_path} was tuned with other training settings {record['bench_args']}: "
                         "use another --out")
    record["bench_args"] = extra
    record["calls"].append({"command": "python -m bench.fednl.retrieval_protocol " + shlex.join(sys.argv[1:]),
                            "date": time.strftime("%Y-%m-%d")})
    for arm, values in grids.items():
        for lr in values:
            folder = runs / f"{arm}-lr{lr:g}"
            parsed = bench_args(extra, algorithms=[ARMS[arm]], seeds=args.tuning_seeds, split="val", out=folder)
            parsed.retrieval_lrs = {arm: lr}
            log(f"tuning {arm} at lr {lr:g} on seeds {args.tuning_seeds}")
            result = section_retrieval(parsed, folder)
            for seed, scored in result["runs"].items():
                run = scored[arm]
                hits = sum(c for c, _ in run["per_length"].values())
                total = sum(n for _, n in run["per_length"].values())
                record["scores"].setdefault(arm, {}).setdefault(f"{lr:g}", {})[seed] = {
                    "answer_ce": round(answer_ce(run), 4), "exact": [hits, total],
                    "gate_alpha_last": (run.get("gate_alpha_by_round") or [None])[-1]}
            record_path.write_text(json.dumps(record, indent=1))
    lines = [f"# Tuning FedNL's passkey comparison on the validation prompts ({time.strftime('%Y-%m-%d')})", "",
             "Every call: " + "; ".join(f"`{c['command']}`" for c in record["calls"]), "",
             "Answer cross-entropy (nats per answer token, lower is better) and exact match, per arm and "
             "learning rate, over the tuning seeds; **bold**: each grid's best.", ""]
    arms = {}
    for arm in ARMS:
        scores = {float(lr): [s["answer_ce"] for s in by_seed.values()]
                  for lr, by_seed in record["scores"].get(arm, {}).items()
                  if all(str(seed) in by_seed for seed in args.tuning_seeds)}
        if not scores:
            continue
        arms[arm] = protocol.arm_entry(scores, "train.lr", higher_is_better=False, tolerance=args.tie_tolerance)
        best = arms[arm]["best"]["train.lr"]
        cells = []
        for lr in sorted(scores):
            exact = [record["scores"][arm][f"{lr:g}"][str(s)]["exact"] for s in args.tuning_seeds]
            text = (f"lr {lr:g} → {sum(scores[lr]) / len(scores[lr]):.3f} "
                    f"({sum(e[0] for e in exact)}/{sum(e[1] for e in exact)} exact)")
            cells.append(f"**{text}**" if lr == best else text)
        tied = arms[arm].get("tied_within", {}).get("train.lr", [])
        lines.append(f"- {arm}: " + ", ".join(cells) + (
            f" (tied within {args.tie_tolerance:g} nats: " + ", ".join(f"{v:g}" for v in tied) + "; the middle taken)"
            if len(tied) > 1 else ""))
    arms["round-0"] = {"no_training": True, "spec": ROUND0}
    spec = {"tuning_seeds": args.tuning_seeds, "evaluation_seeds": args.evaluation_seeds, "split": "validation",
            "kind": "superiority", "margin": 100 * TARGET_GAIN, "metric": "exact match, pp (tuned on answer CE)",
            "targets": {"fednl_minus_ablation_pp": 100 * TARGET_GAIN, "p_below": TARGET_P,
                        "share_of_gap_recovered": TARGET_SHARE},
            "bench_args": extra, "evaluation": {"lengths": args.lengths, "prompts": args.prompts,
                                                    "local_prompts": args.local_prompts},
            "arms": arms, "changes_after_results": []}
    if args.draft:
        why = protocol.write_draft(spec, out / args.draft)
        lines += ["", f"protocol check of {args.draft}: " + ("**passes**" if why is None else f"refused: {why}")]
    (out / "tuning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def pooled_difference(items: dict, length: int, ref: str, method: str = "fednl"
                      ) -> tuple[float, tuple[float, float], int]:
    """``method`` − ``ref`` exact match at ``length``, every evaluation seed's prompts pooled, paired prompt
    by prompt (the same prompts, ordered by index): the mean, its 95% t interval, the number of pairs."""
    import numpy as np

    from .stats import t_interval

    diffs = []
    for runs in items.values():
        if method not in runs or ref not in runs:
            continue
        pair = []
        for name in (method, ref):
            keep = runs[name]["length"] == length
            order = np.argsort(runs[name]["index"][keep])
            pair.append((runs[name]["index"][keep][order], (runs[name]["correct"][keep][order] > 0.5).astype(float)))
        if not np.array_equal(pair[0][0], pair[1][0]):
            raise ValueError(f"{method} and {ref} scored different prompts at {length} tokens")
        diffs.append(pair[0][1] - pair[1][1])
    d = np.concatenate(diffs)
    if len(d) < 2:
        return float(d.mean()), (-math.inf, math.inf), len(d)
    stats = t_interval(d)
    return stats["mean"], tuple(stats["ci95"]), stats["n"]


def records_from_counts(args) -> int:
    """Records (``--retrieval-keep``) rebuilt from a ``retrieval.json`` whose runs' folders are gone, for
    a seed where the per-prompt pairs follow from the counts alone: every arm but FedNL got all or none of a
    length's prompts right, so every order of FedNL's right answers gives the same paired statistics
    (McNemar's discordant counts, the paired mean and its interval, the share of the gap). Refused (exit 2)
    otherwise. Per-prompt answer CE is not rebuilt (NaN); each row keeps its arm's mean answer CE."""
    source = json.loads(Path(args.source).read_text())
    keep = Path(args.keep)
    for seed in [str(s) for s in (args.seeds or source["runs"])]:
        runs = source["runs"].get(seed)
        if not runs or "fednl" not in runs:
            print(f"refused: {args.source} has no FedNL run for seed {seed}", file=sys.stderr)
            return 2
        lengths = sorted({int(n) for row in runs.values() for n in row["per_length"]})
        for key, row in runs.items():
            for n in lengths:
                right, total = row["per_length"].get(str(n), (None, None))
                if total != runs["fednl"]["per_length"].get(str(n), (0, -1))[1]:
                    print(f"refused: seed {seed}, {key} scored another number of {n}-token prompts than FedNL",
                          file=sys.stderr)
                    return 2
                if key != "fednl" and right not in (0, total):
                    print(f"refused: seed {seed}, {key} got {right}/{total} of the {n}-token prompts right: the "
                          "pairs with FedNL do not follow from the counts", file=sys.stderr)
                    return 2
        for key, row in runs.items():
            correct, length = [], []
            for n in lengths:
                right, total = row["per_length"][str(n)]
                correct += [1.0] * right + [0.0] * (total - right)
                length += [n] * total
            items = {"correct": correct, "loss": [math.nan] * len(correct), "index": range(len(correct)),
                     "length": length, "client": [0] * len(correct)}
            write_record(record_path(keep, key, seed), row, items, rebuilt_from_counts=str(args.source))
        log(f"seed {seed}: {len(runs)} records rebuilt from {args.source} into {keep}")
    return 0


def evaluate(args) -> int:
    from bench import protocol

    try:
        spec, commit = protocol.load(Path(args.protocol))
    except protocol.ProtocolError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2
    arms = {name: arm for name, arm in spec["arms"].items() if not arm.get("no_training")}
    if set(arms) != set(ARMS):
        print(f"refused: the protocol's arms {sorted(arms)} are not {sorted(ARMS)}", file=sys.stderr)
        return 2
    seeds = args.seeds or spec["evaluation_seeds"]
    if set(seeds) - set(spec["evaluation_seeds"]):
        print(f"refused: --seeds {sorted(set(seeds) - set(spec['evaluation_seeds']))} are not among the protocol's "
              f"evaluation seeds {spec['evaluation_seeds']}", file=sys.stderr)
        return 2
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    parsed = bench_args(spec["bench_args"], algorithms=[*ALGORITHMS, ROUND0], seeds=seeds,
                        split="test", out=runs, lengths=spec["evaluation"]["lengths"],
                        prompts=spec["evaluation"]["prompts"],
                        local_prompts=int(spec["evaluation"].get("local_prompts", 0)), keep=out / "runs")
    parsed.retrieval_lrs = {name: float(arm["best"]["train.lr"]) for name, arm in arms.items()}
    result = section_retrieval(parsed, runs)
    items = {seed: {key: read_record(record_path(parsed.retrieval_keep, key, seed))[1] for key in by_arm}
             for seed, by_arm in result["runs"].items()}
    rebuilt = sorted({seed for seed, by_arm in result["runs"].items() for row in by_arm.values()
                      if row.get("rebuilt_from_counts")})
    verdicts = {}
    for length in parsed.passkey_lengths:
        diff, interval, n = pooled_difference(items, length, "fednl-ablate")
        untrained = pooled_difference(items, length, "fednl-ablate", method="fednl-round0")[0]  # no-training arm
        pooled = result["paired"].get(str(length), {})
        p_value = pooled.get("fednl-ablate", {}).get("p_value", 1.0)
        share = (pooled.get("recovered") or {}).get("share")
        verdicts[str(length)] = {
            "fednl_minus_ablation_pp": 100 * diff, "ci95_pp": [100 * v for v in interval], "pairs": n,
            "p_value": p_value,
            "round0_minus_ablation_pp": 100 * untrained,
            "gain": protocol.verdict(100 * diff, [100 * v for v in interval], spec["margin"], kind=spec["kind"],
                                     no_training=100 * untrained),
            "p_below_target": p_value < spec["targets"]["p_below"], "share_recovered": share,
            "share_met": share is not None and share >= spec["targets"]["share_of_gap_recovered"]}
    result["protocol"] = {"file": str(args.protocol), "commit": commit, "lrs": parsed.retrieval_lrs,
                          "changes_after_results": spec.get("changes_after_results", [])}
    result["verdicts"] = verdicts
    (out / "retrieval.json").write_text(json.dumps(result, indent=2, default=str))
    lines = [f"# FedNL's passkey comparison under {args.protocol} (committed at {commit[:12]})", "",
             f"Made by `python -m bench.fednl.retrieval_protocol {shlex.join(sys.argv[1:])}`, "
             f"{time.strftime('%Y-%m-%d')}. Evaluation seeds {spec['evaluation_seeds']} (tuned on "
             f"{spec['tuning_seeds']}, validation); learning rates: "
             + ", ".join(f"{k} {v:g}" for k, v in parsed.retrieval_lrs.items())
             + "; the no-training arm is FedNL at init (`fednl-round0`). Changes made after a result was seen: "
             + ("; ".join(c.rstrip(".") for c in spec.get("changes_after_results") or []) or "none") + "."
             + (f" Seeds {', '.join(rebuilt)}: the runs' folders were lost with a session's machine; their "
                "records were rebuilt from the counts in their earlier retrieval.json (`records-from-counts`: "
                "exact, as every arm paired with FedNL got all or none of a length's prompts right; per-prompt "
                "answer CE is not kept for them)." if rebuilt else ""),
             retrieval_lines(result), "## Verdicts (one rule: the 95% interval's bound against the margin)", ""]
    for length, v in verdicts.items():
        lines.append(f"- {length} tokens: FedNL − ablation {v['fednl_minus_ablation_pp']:+.1f} pp "
                     f"({v['ci95_pp'][0]:+.1f} to {v['ci95_pp'][1]:+.1f}, {v['pairs']} pairs; FedNL untrained − "
                     f"ablation {v['round0_minus_ablation_pp']:+.1f}), margin "
                     f"+{spec['margin']:g} pp: **{v['gain']}**; p {v['p_value']:.2g} (target < "
                     f"{spec['targets']['p_below']}: {'met' if v['p_below_target'] else 'not met'}); gap recovered "
                     + ("–" if v["share_recovered"] is None else f"{v['share_recovered']:.0%}")
                     + f" (target ≥ {spec['targets']['share_of_gap_recovered']:.0%}: "
                     + ("met" if v["share_met"] else "not met") + ")")
    (out / "retrieval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.fednl.retrieval_protocol", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="every arm's lr on the validation prompts; drafts the protocol")
    t.add_argument("--lr-grid", action="append", default=[], help="ARM=v1,v2,... (arms: fednl, fednl-ablate, "
                                                                  "fedavg-lora)")
    t.add_argument("--tuning-seeds", type=int, nargs="+", default=[100])
    t.add_argument("--evaluation-seeds", type=int, nargs="+", default=[0, 1, 2])
    t.add_argument("--lengths", default="512,1024", help="the evaluation's prompt lengths")
    t.add_argument("--prompts", type=int, default=200, help="the evaluation's held-out prompts per length")
    t.add_argument("--tie-tolerance", type=float, default=1e-3,
                   help="answer CE (nats) within which an arm's grid values tie; the middle tied value is taken "
                        "(an arm at the ceiling at every rate gets an inner one)")
    t.add_argument("--local-prompts", type=int, default=20,
                   help="the evaluation's aggregation drop: held-out prompts each client scores its local model on")
    t.add_argument("--out", required=True, help="tuning.json, tuning.md and the drafted protocol")
    t.add_argument("--runs", required=True, help="the tuning runs' folders (resumable)")
    t.add_argument("--draft", default="", help="file name (in --out) of the protocol drafted from the runs")
    e = sub.add_parser("evaluate", help="every arm at its tuned lr on the test prompts, under a committed protocol")
    e.add_argument("protocol")
    e.add_argument("--out", required=True)
    e.add_argument("--runs", required=True, help="the evaluation runs' folders (resumable)")
    e.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="run only these of the protocol's evaluation seeds (a part; default: all of them)")
    r = sub.add_parser("records-from-counts", help="evaluation records rebuilt from an earlier retrieval.json's "
                                                   "counts, where the pairs follow from them (runs' folders lost)")
    r.add_argument("source", help="an earlier retrieval.json (its runs' rows)")
    r.add_argument("--keep", required=True, help="the records' folder (evaluate's <--out>/runs)")
    r.add_argument("--seeds", type=int, nargs="+", default=None, help="default: every seed in the source")
    args = p.parse_args(argv)
    if args.command == "records-from-counts":
        return records_from_counts(args)
    if args.command == "tune":
        return tune(args, extra)
    if extra:
        p.error("evaluate takes its training settings from the protocol, not after --")
    return evaluate(args)


if __name__ == "__main__":
    raise SystemExit(main())
