"""FLITE (fp32 and int4 latents) against full-weight and compressed-update baselines on CIFAR-10.

    .venv/bin/python bench/flite.py                            # far regime (ImageNet base), ~33 min on 2 cores
    .venv/bin/python bench/flite.py --base public --seeds 3 --out docs/bench/flite-near   # near regime
    .venv/bin/python bench/flite.py --quick --out /tmp/flite-quick   # a smoke test in a few minutes

Under the evidence protocol (docs/benchmarks.md, "Protocol"): tune on a validation split, commit
the drafted protocol, then evaluate under it (resumable: the same command again keeps the runs done)::

    .venv/bin/python bench/flite.py --tune --base public --task fmnist --seed-list 100 \
        --lr-grid flite-int4=3e-4,1e-3,3e-3,1e-2 --lr-grid fedavg-full=1e-5,3e-5,1e-4,3e-4 --out DIR
    git add DIR/protocol.json && git commit -m "protocol"      # before any evaluation run
    .venv/bin/python bench/flite.py --protocol DIR/protocol.json --out DIR

Two regimes (``--base``): ``model`` starts every method from the ImageNet MobileNetV2 (the
*far* regime: the base never saw the task); ``public`` starts every method from θ_pre, the
same backbone trained centrally on the task's public split (20% of every class, disjoint
from the clients' data) under the frozen orthogonal head (``clients.pretrain``, built
once and cached; the *near* regime FLITE's paper assumes). ``--task`` picks CIFAR-10 or
Fashion-MNIST. ``--seeds N`` repeats FLITE-int4 and fedavg-full with seeds 0..N-1 (mean ±
std and a 95% t-interval of the gap); the other methods run with seed 0.

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
full-latent-int4   fedavg-full through the latent channel (``channel=latent``): FLITE's factors
                   drawn afresh every round over every weight, 1,280 int4 latents = 648 B up;
                   down, every round's combined latents so far in fp32 (5,120 B a round; the
                   clients replay them: the same model as a dense downlink; docs/channels.md)
fedavg-lora        PEFT LoRA r=8 on every 1x1 convolution, FLITE's frozen orthogonal head
topk-ef            full update, top 1% entries per tensor (index + value), error feedback
powersgd           full update, PowerSGD rank 4 per weight matrix, error feedback
=================  =========================================================================

Reported (``OUT/flite.md``, ``flite.json``, ``flite.png``, with the command that made them):
final accuracy per method and partition (mean ± std over seeds), each method's gain over its
starting point (round 0: θ_pre in the near regime), uplink payload bytes per client per
round, the ratio of fedavg-full's bytes to the method's, and a plot of accuracy against
cumulative uplink bytes per client (the Pareto view; seed 0), one panel per partition. Targets from the
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
sys.path.insert(0, str(ROOT / "bench"))

import protocol  # noqa: E402  bench/protocol.py: the one rule for "met"

from flite_arms import BASES, METHODS, NEAR_LR, PARTITIONS, REFERENCE, REPEATED, TASKS  # noqa: E402
import flite_report  # noqa: E402


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
    p.add_argument("--seeds", type=int, default=1, help=f"seeds 0..N-1 for {' and '.join(REPEATED)} (others: 0)")
    p.add_argument("--seed-list", type=int, nargs="+", default=None, metavar="SEED",
                   help="these seeds instead of 0..N-1 (to add seeds to an earlier report's runs)")
    p.add_argument("--base", choices=list(BASES), default="model", help="; ".join(f"{k}: {v}" for k, v in BASES.items()))
    p.add_argument("--task", choices=list(TASKS), default="cifar10")
    p.add_argument("--quick", action="store_true",
                   help="2 rounds x 3 steps, IID, flite-int4 and fedavg-full only (a few minutes)")
    p.add_argument("--lr", action="append", default=[], metavar="METHOD=VALUE",
                   help="learning rate of one method (repeatable); defaults: "
                        + ", ".join(f"{m}={v:g}" for m, (_, _, v) in METHODS.items())
                        + "; with --base public: " + ", ".join(f"{m}={v:g}" for m, v in NEAR_LR.items()))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "flite", help="report folder")
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-flite",
                   help="folder of the run folders (default outputs/bench-flite)")
    p.add_argument("--render", action="store_true", help="only re-write the report and plot from OUT/flite.json")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="FLITE_JSON",
                   help="one report from the runs of these flite.json files (parts of one benchmark run at "
                        "different times, e.g. seeds or methods added later; same protocol): OUT/flite.json "
                        "gets their union, a later file's run replacing an earlier one's")
    p.add_argument("--tune", action="store_true",
                   help="tuning under the protocol (docs/benchmarks.md): every --lr-grid value of every method on "
                        "every --seed-list seed, scored on a validation split (task.eval_split=val), never the "
                        "test items; OUT/tuning.json collects the runs (a later call adds to them, e.g. to extend a "
                        "grid) and OUT/protocol.json is drafted from them (best value per method and partition)")
    p.add_argument("--lr-grid", action="append", default=[], metavar="METHOD=V1,V2,...",
                   help="with --tune: the learning rates to try for one method (repeatable; every method the same "
                        "number of values: the same tuning budget)")
    p.add_argument("--draft", default="protocol.json", metavar="NAME",
                   help="with --tune: the drafted protocol's file name in OUT (e.g. protocol-iid.json for a protocol "
                        "of the --partitions / --methods given only; default protocol.json)")
    p.add_argument("--evaluation-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], metavar="SEED",
                   help="with --tune: the evaluation seeds written into the drafted protocol (default 0-4)")
    p.add_argument("--margin", type=float, default=-1.0,
                   help="with --tune: the non-inferiority margin in pp written into the protocol (default -1)")
    p.add_argument("--protocol", type=Path, default=None, metavar="PROTOCOL_JSON",
                   help="evaluate under this committed protocol file (its methods, partitions, tuned learning "
                        "rates, evaluation seeds, rounds/steps/clients and θ_pre; refused when it fails "
                        "bench/protocol.py check, is not committed as it is, or θ_pre differs); the report names "
                        "its commit; the same command again resumes: runs already in OUT/flite.json are kept; "
                        "--methods / --partitions run a part of its arms (seed by seed)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    lrs = {m: v for m, (_, _, v) in METHODS.items()}
    if args.base == "public":
        lrs.update(NEAR_LR)
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
    args.partition_lrs = {}  # (partition, method) -> lr: a protocol's tuned values
    args.grid = {}
    for item in args.lr_grid:
        method, _, values = item.partition("=")
        if method not in METHODS:
            p.error(f"--lr-grid: unknown method '{method}'; choose from {', '.join(METHODS)}")
        try:
            args.grid[method] = sorted({float(v) for v in values.split(",") if v.strip()})
        except ValueError:
            p.error(f"--lr-grid {item}: give numbers separated by commas")
        if len(args.grid[method]) < 3 or min(args.grid[method]) <= 0:
            p.error(f"--lr-grid {item}: at least 3 learning rates > 0 (a grid must bracket its best value)")
    if args.tune:
        if not args.grid or not args.seed_list:
            p.error("--tune needs --lr-grid for each method and --seed-list (the tuning seeds)")
        if len({len(v) for v in args.grid.values()}) > 1:
            p.error(f"--lr-grid: every method needs as many values (the same tuning budget), got "
                    f"{ {m: len(v) for m, v in args.grid.items()} }")
        args.methods = list(args.grid)
        args.overrides = [*args.overrides, "task.eval_split=val"]
    elif args.grid:
        p.error("--lr-grid goes with --tune")
    if args.protocol is not None:
        apply_protocol(args, p)
    if args.quick:
        args.rounds, args.steps, args.partitions = 2, 3, ["iid"]
        args.methods = [m for m in args.methods if m in REPEATED] or list(REPEATED)
    for name in ("rounds", "steps", "batch_size", "clients", "seeds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.render and REFERENCE not in args.methods:
        log(f"note: without {REFERENCE} the byte ratios and the accuracy gap are not reported")
    return args


def lr_of(args, method: str, partition: str) -> float:
    return args.partition_lrs.get((partition, method), args.lrs[method])


def config_for(args, method: str, partition: str, seed: int, lr: float | None = None):
    from fedapps.config import compose

    algorithm, overrides, _ = METHODS[method]
    lr = lr_of(args, method, partition) if lr is None else lr
    tag = f"_lr{lr:g}_val" if args.tune else ""
    items = [*PARTITIONS[partition], *overrides, f"rounds={args.rounds}", f"num_clients={args.clients}",
             f"seed={seed}", f"train.lr={lr}", f"train.local_steps={args.steps}",
             f"train.batch_size={args.batch_size}", "train.threads=1", "eval.max_batches=0",
             "eval.batch_size=64", f"run_name=flite-bench_{args.base}_{args.task}_{partition}_{method}_s{seed}{tag}",
             f"output_dir={args.runs}", *args.overrides]
    return compose(items, task=args.task, algorithm=algorithm, base=args.base, preset="none")


def apply_protocol(args, parser) -> None:
    """Evaluation under a committed protocol file: its settings replace the command line's."""
    try:
        spec, args.protocol_commit = protocol.load(args.protocol)
    except protocol.ProtocolError as err:
        parser.exit(2, f"bench/flite.py --protocol: refused: {err}\n")
    settings = spec.get("settings") or {}
    for key in ("rounds", "steps", "batch_size", "clients", "base", "task"):
        if key in settings:
            setattr(args, key, settings[key])
    args.overrides = [*settings.get("overrides", []), *args.overrides]
    args.partition_lrs, methods, partitions = {}, [], []
    for name, arm in spec["arms"].items():
        if arm.get("no_training"):
            continue
        partition, _, method = name.partition("/")
        if partition not in PARTITIONS or method not in METHODS:
            parser.exit(2, f"bench/flite.py --protocol: refused: arm '{name}' is not PARTITION/METHOD\n")
        args.partition_lrs[(partition, method)] = float(arm["best"]["train.lr"])
        methods.append(method)
        partitions.append(partition)
    chosen = args.methods if args.methods != list(METHODS) else None  # --methods given: a part of the protocol's arms
    args.methods = [m for m in dict.fromkeys(methods) if chosen is None or m in chosen]
    args.partitions = [p for p in dict.fromkeys(partitions) if p in args.partitions]
    if not args.methods or not args.partitions:
        parser.exit(2, f"bench/flite.py --protocol: --methods / --partitions leave none of the protocol's arms "
                       f"({', '.join(a for a in spec['arms'] if '/' in a)})\n")
    args.seed_list, args.protocol_spec = [int(s) for s in spec["evaluation_seeds"]], spec


def seeds_of(args, method: str) -> list[int]:
    if method not in REPEATED and not (args.tune or args.protocol):
        return [0]
    return list(args.seed_list) if args.seed_list else list(range(args.seeds))


def run_all(args) -> dict:
    from fedapps.outputs import cumulative_curve
    from fedapps.simulation import simulate

    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                if k not in ("lr", "partition_lrs", "protocol_spec", "protocol_commit", "lr_grid")}
    results = {"runs": {}, "settings": settings}
    if args.base == "public":  # θ_pre once, before the runs (each would otherwise wait on the first)
        import hashlib

        from clients.pretrain import ensure_base, read_report

        cfg = config_for(args, args.methods[0], args.partitions[0], 0)  # θ_pre does not depend on the method
        path = ensure_base(cfg)
        log(f"θ_pre: {path}")
        results["base"] = read_report(cfg)
        # θ_pre is not bit-reproducible across CPUs: the report names the very file, and --merge refuses another
        results["base"]["sha256"] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if getattr(args, "protocol_spec", None) is not None:
        expected = (args.protocol_spec.get("settings") or {}).get("base_sha256")
        found = (results.get("base") or {}).get("sha256")
        if expected and found != expected:
            raise SystemExit(f"bench/flite.py --protocol: θ_pre here is {str(found)[:12]}, the protocol was tuned on "
                             f"{expected[:12]}: not the same base model (pretraining is not bit-reproducible across "
                             "CPUs; evaluate where the protocol was tuned, or tune again here)")
        results["protocol"] = {"file": str(args.protocol), "commit": args.protocol_commit, **args.protocol_spec}
    name = "tuning.json" if args.tune else "flite.json"
    resume = args.tune or results.get("protocol") is not None
    if resume and (args.out / name).exists():  # a later call adds runs: a grid extended, an evaluation resumed
        earlier = json.loads((args.out / name).read_text())
        differ = [k for k in PROTOCOL if earlier["settings"].get(k) != results["settings"].get(k)]
        if (earlier.get("protocol") or {}).get("commit") != (results.get("protocol") or {}).get("commit"):
            differ.append("protocol commit")
        if differ:
            raise SystemExit(f"bench/flite.py: {args.out / name} was made with other {', '.join(differ)}: "
                             "use another --out")
        results["runs"] = earlier["runs"]
        results["commands"] = protocol.commands_of(earlier)
    lrs = (lambda m: args.grid[m]) if args.tune else (lambda m: [None])
    jobs = [(p, m, seed, lr) for p in args.partitions for m in args.methods for lr in lrs(m)
            for seed in seeds_of(args, m)]
    if resume and not args.tune:  # an evaluation in parts: every arm of a seed before the next seed
        jobs.sort(key=lambda job: seeds_of(args, job[1]).index(job[2]))
    for done, (partition, method, seed, lr) in enumerate(jobs, 1):
        lr = lr_of(args, method, partition) if lr is None else lr
        key = f"{partition}/{method}/{lr:g}/{seed}" if args.tune else f"{partition}/{method}/{seed}"
        if resume and key in results["runs"]:
            log(f"[{done}/{len(jobs)}] {key}: already in {args.out / name}")
            continue
        cfg = config_for(args, method, partition, seed, lr)
        split = " (validation split)" if args.tune else ""
        log(f"[{done}/{len(jobs)}] {method} on {TASKS[args.task]} {partition}, seed {seed} (lr {lr:g}){split}")
        start = time.time()
        summary = simulate(cfg)
        seconds = time.time() - start
        results["runs"][key] = {
            "method": method, "partition": partition, "seed": seed, "algorithm": summary["algorithm"],
            "lr": lr, "initial_accuracy": summary["initial_metric"],
            "final_accuracy": summary["final_metric"],
            "uplink_bytes_per_client_round": summary["uplink_bytes_per_client_round"],
            "uplink_message_bytes_per_client_round": summary.get("uplink_message_bytes_per_client_round"),
            "uplink_wire_bytes_per_client_round": summary.get("uplink_wire_bytes_per_client_round"),
            "downlink_bytes_per_client_round": summary["downlink_bytes_per_client_round"],
            "refused_replies": summary["refused_replies"], "seconds": seconds,
            "curve": cumulative_curve(summary["run_dir"], "accuracy"), "run_dir": summary["run_dir"],
        }
        log(f"    accuracy {summary['initial_metric']:.4f} -> {summary['final_metric']:.4f}, "
            f"uplink {summary['uplink_bytes_per_client_round']:,.0f} B/client/round, {seconds:.0f} s")
        (args.out / name).write_text(json.dumps(results, indent=2) + "\n")  # partial results survive
    return results


PROTOCOL = ("rounds", "steps", "batch_size", "clients", "base", "task", "overrides")  # what parts of one benchmark share


def merge(paths: list[Path]) -> dict:
    """The union of several flite.json files' runs (refused when their protocols differ)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]["settings"]
    merged = {"runs": {}, "settings": dict(first), "base": parts[0].get("base"), "protocol": parts[0].get("protocol"),
              "command": "; ".join(part.get("command", "?") for part in parts)}
    for path, part in zip(paths, parts):
        differ = [k for k in PROTOCOL if part["settings"].get(k, first.get(k)) != first.get(k)]
        if differ:
            raise SystemExit(f"bench/flite.py --merge: {path} differs from {paths[0]} in {', '.join(differ)}: "
                             "not parts of one benchmark")
        theirs, ours = (part.get("base") or {}).get("sha256"), (parts[0].get("base") or {}).get("sha256")
        if theirs != ours:
            raise SystemExit(f"bench/flite.py --merge: {path} was made from θ_pre {str(theirs)[:12]}, {paths[0]} from "
                             f"{str(ours)[:12]}: not the same base model (pretraining is not bit-reproducible across "
                             "CPUs; run every part on one θ_pre file)")
        if (part.get("protocol") or {}).get("commit") != (parts[0].get("protocol") or {}).get("commit"):
            raise SystemExit(f"bench/flite.py --merge: {path} was evaluated under another protocol commit than "
                             f"{paths[0]}: not parts of one benchmark")
        merged["runs"].update(part["runs"])
        for key in ("methods", "partitions"):
            merged["settings"][key] = list(dict.fromkeys([*merged["settings"][key], *part["settings"][key]]))
    for (partition, method), runs in flite_report.grouped(merged).items():
        if len({r["lr"] for r in runs}) > 1:
            raise SystemExit(f"bench/flite.py --merge: {method} on {partition} has runs at learning rates "
                             f"{sorted({r['lr'] for r in runs})}: one method, one learning rate per report")
    return merged


def draft_protocol(results: dict, args) -> dict:
    """The protocol file the tuning runs give: per partition and method, its grid and the value with the
    best mean validation accuracy over the tuning seeds; the evaluation seeds, the margin, the settings
    every evaluation run shares, θ_pre's sha256 and the no-training arm."""
    arms = {}
    for (partition, method), runs in flite_report.grouped(results).items():
        if partition not in args.partitions or method not in args.methods:  # a protocol for a part of the runs
            continue
        scores: dict[float, list[float]] = {}
        for run in runs:
            scores.setdefault(float(run["lr"]), []).append(float(run["final_accuracy"]))
        arms[f"{partition}/{method}"] = protocol.arm_entry(scores, "train.lr")
    arms["theta-pre"] = {"no_training": True, "what": "round 0 of every evaluation run: θ_pre on the same test items"}
    s = results["settings"]
    return {
        "comparison": f"FLITE near/far regime on {TASKS[s['task']]} (bench/flite.py --protocol)",
        "tuning_seeds": sorted({int(r["seed"]) for r in results["runs"].values()}),
        "evaluation_seeds": list(args.evaluation_seeds), "split": "validation",
        "margin": float(args.margin), "kind": "non-inferiority", "reference": REFERENCE,
        "settings": {"rounds": s["rounds"], "steps": s["steps"], "batch_size": s["batch_size"],
                     "clients": s["clients"], "base": s["base"], "task": s["task"],
                     "overrides": [o for o in s["overrides"] if o != "task.eval_split=val"],
                     "base_sha256": (results.get("base") or {}).get("sha256")},
        "arms": arms, "changes_after_results": [],
        "tuning_commands": protocol.commands_of(results),  # grids extended: later calls
    }


def machine() -> str:
    import os
    import platform

    return f"{platform.machine()} Linux, {os.cpu_count()} CPU cores, torch CPU"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = ("bench/flite.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))).strip()
    if args.tune:
        results = run_all(args)
        results["commands"] = [*results.get("commands", []), command]  # every call that added runs
        results["command"] = "; ".join(results["commands"])
        (args.out / "tuning.json").write_text(json.dumps(results, indent=2) + "\n")
        draft = draft_protocol(results, args)
        refusal = protocol.write_draft(draft, args.out / args.draft)
        every = argparse.Namespace(**{**vars(args), "partitions": list(PARTITIONS), "methods": list(METHODS)})
        text = flite_report.tuning_report(results, draft_protocol(results, every), refusal, results["command"], args.draft)
        (args.out / "tuning.md").write_text(text)
        print(text)
        log(f"tuning: {args.out / 'tuning.md'}; protocol draft: {args.out / args.draft}"
            + (" (refused: extend the grid with another --tune call to the same --out)" if refusal else
               " (commit it, then: bench/flite.py --protocol " + str(args.out / args.draft) + ")"))
        return 2 if refusal else 0
    if args.merge:
        results = merge(args.merge)
        results["command"] = f"{command} (merging: {results['command']})"
    elif args.render:
        results = json.loads((args.out / "flite.json").read_text())
        command = results.get("command", command)
    else:
        results = run_all(args)
        results["commands"] = [*results.get("commands", []), command]  # an evaluation resumed: every part's call
        results["command"] = "; ".join(results["commands"])
    if not args.render:  # the day the runs were made or merged: a later --render keeps it
        results["date"] = time.strftime("%Y-%m-%d")
        (args.out / "flite.json").write_text(json.dumps(results, indent=2) + "\n")
    flite_report.plot(results, args.out / "flite.png")
    text = flite_report.report(results, results["command"], machine())
    (args.out / "flite.md").write_text(text)
    print(text)
    log(f"report: {args.out / 'flite.md'}; plot: {args.out / 'flite.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
