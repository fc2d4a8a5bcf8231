"""The command line (``python -m bench.fednl``): its flags and their checks, and the run of the
chosen sections in order into ``--out``'s dated folder (results.json, fednl-bench.md, plots)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from . import __doc__ as OVERVIEW
from .docs import plots, render, write_docs
from .lm import section_lm
from .mmlu import mmlu_from, mmlu_paired, save_items, section_mmlu
from .niah import niah_from, section_niah
from .passkey import add_arguments as passkey_arguments
from .passkey import finish_args as passkey_finish
from .passkey import passkey_lines, section_passkey
from .report import report, section_times
from .retrieval import add_arguments as retrieval_arguments
from .retrieval import finish_args as retrieval_finish
from .retrieval import retrieval_lines, section_retrieval
from .runs import MODULE, ROOT, log
from .stream import section_stream, stream_worker
from .throughput import section_throughput

SECTIONS = ("mmlu", "niah", "lm", "stream", "throughput", "passkey", "retrieval")
ALGORITHMS = ("fedavg-lora", "fedprox", "ffa-lora", "fedala", "fedssi", "fednl:meta-rules", "fednl:gate",
              "fednl:ablate")
NIAH_ALGORITHMS = ("fednl:meta-rules", "fednl:ablate", "fedavg-lora")
LM_ALGORITHMS = ("fednl:meta-rules", "fednl:ablate", "fedavg-lora")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=OVERVIEW.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny-llama (pipeline checks)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="MMLU runs; fednl:<mode> picks the payload mode")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--local-steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-batches", type=int, default=2, help="MMLU test batches of 8 per client (0 = all, <=200)")
    p.add_argument("--mmlu-max-length", type=int, default=256, help="MMLU prompt tokens (longer ones are cut from the left)")
    p.add_argument("--mmlu-test", type=int, default=200,
                   help="held-out MMLU questions per client at most (task.max_test; a sixth of a super-category "
                        "at most: 700 gives 2,257 over the 5 clients)")
    p.add_argument("--paired", action="store_true",
                   help="MMLU: also score every final model, and the untrained ones (round 0), on all held-out "
                        "questions, item by item, and compare them paired (95%% intervals, McNemar, "
                        "non-inferiority at --margin) against fedavg-lora and FedNL against its ablation")
    p.add_argument("--margin", type=float, default=0.02, help="non-inferiority margin of --paired (0.02 = 2 points)")
    p.add_argument("--mmlu-add", default="",
                   help="with --mmlu-from: comma list of algorithms to train and add to those runs (a part added "
                        "to a combined result; with --paired the scores the files carry, round 0 included, are "
                        "not computed again)")
    p.add_argument("--mmlu-from", default="",
                   help="comma list of results.json files of earlier MMLU runs (e.g. one algorithm each): their runs "
                        "are taken as this run's MMLU section instead of training (with --paired: compared together; "
                        "per-question scores a --paired run saved beside its results.json, in mmlu_items/, are "
                        "reused, so such a file needs no run folder)")
    p.add_argument("--fednl-overrides", default="",
                   help="Hydra overrides for FedNL's runs only (its modes and its ablation), e.g. "
                        "\"algorithm.lr.gate=0.05\"; checked before anything runs")
    p.add_argument("--fedala-overrides", default="",
                   help="Hydra overrides for FedALA's runs only, e.g. \"algorithm.ala.eta=1000\" (its η tuned on "
                        "validation by bench/fedala_eta.py); checked before anything runs")
    p.add_argument("--niah-rounds", type=int, default=1)
    p.add_argument("--niah-steps", type=int, default=3)
    p.add_argument("--niah-train-length", type=int, default=768, help="(the multi-value template needs >= ~510)")
    p.add_argument("--niah-lengths", default="1024,2048,4096")
    p.add_argument("--niah-algorithms", default=",".join(NIAH_ALGORITHMS),
                   help="NIAH (and stream) runs: FedNL, its ablation (memory off), fedavg-lora")
    p.add_argument("--niah-test-per-template", type=int, default=3, help="test prompts per client (balanced over lengths)")
    p.add_argument("--window", type=int, default=512, help="FedNL's softmax window on NIAH and streams")
    p.add_argument("--stream-length", type=int, default=16384)
    p.add_argument("--memory-lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--block", type=int, default=256, help="tokens per streamed block")
    p.add_argument("--stream-from", choices=("niah", "lm", "init"), default="niah",
                   help="stream the NIAH section's trained models, the lm section's, or the untrained ones "
                        "(memory only needs these)")
    p.add_argument("--niah-resume", default="",
                   help="folder of an earlier (possibly stopped) NIAH run: each algorithm whose run there finished "
                        "and was scored (niah_<name>/niah_items.npz) is taken as it is; only the others train")
    p.add_argument("--niah-from", default="",
                   help="results.json of an earlier NIAH run: its trained models and scores are this run's NIAH "
                        "section (the stream streams them) instead of training again")
    p.add_argument("--throughput-steps", type=int, default=3)
    p.add_argument("--throughput-batch", type=int, default=2)
    p.add_argument("--throughput-seq", type=int, default=512)
    p.add_argument("--throughput-chunks", default="",
                   help="comma list of extra chunk sizes of FedNL's training-time delta rule, timed beside the default")
    p.add_argument("--throughput-memory-heads", default="query,kv",
                   help="comma list of FedNL's algorithm.memory.memory_heads modes timed side by side (query: one "
                        "memory per query head, kv: one per key/value head); the default mode is always timed")
    p.add_argument("--throughput-variants", default="",
                   help="FedNL variants timed beside the default, separated by ';', each a space-separated list of "
                        "Hydra overrides, e.g. \"algorithm.memory.layers=[12,18,23];algorithm.memory.window=64\"")
    p.add_argument("--throughput-profile", action="store_true",
                   help="also profile one step of FedNL and of plain LoRA (torch.profiler): where FedNL's extra "
                        "time goes, by operator")
    p.add_argument("--lm-window", type=int, default=32,
                   help="lm: FedNL's softmax window (its 4 sink tokens aside) on Shakespeare windows of --lm-seq")
    p.add_argument("--lm-seq", type=int, default=256, help="lm: tokens per training and held-out window")
    p.add_argument("--lm-rounds", type=int, default=3)
    p.add_argument("--lm-steps", type=int, default=10, help="lm: local steps per round (batches of 2 windows)")
    p.add_argument("--lm-algorithms", default=",".join(LM_ALGORITHMS),
                   help="lm: FedNL, its ablation (the same window and sinks, memory off), fedavg-lora (full attention)")
    passkey_arguments(p)
    retrieval_arguments(p)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads of in-process measurements")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench-fednl"), help="folder for run folders and results")
    p.add_argument("--write-docs", action="store_true", help="update docs/fednl.md and docs/fednl-*.png")
    p.add_argument("--quick", "--smoke", dest="smoke", action="store_true",
                   help="tiny model and sizes: checks the pipeline in minutes (as bench/flite.py --quick)")
    p.add_argument("--render", help="comma list of results.json files: print (and with --write-docs, write) "
                                    "their tables and plots again, without running anything")
    p.add_argument("--stream-worker", help=argparse.SUPPRESS)  # internal: one streaming measurement (JSON spec)
    args = p.parse_args(argv)
    if args.smoke:
        args.model = "tiny-llama"
        args.rounds, args.local_steps, args.eval_batches = 1, 2, 1
        args.niah_rounds, args.niah_steps, args.niah_train_length = 1, 1, 640
        args.niah_lengths, args.niah_test_per_template, args.window = "640,768", 2, 128
        args.stream_length, args.memory_lengths, args.block = 2048, "512,1024,2048", 128
        args.throughput_steps, args.throughput_seq = 1, 128
        args.lm_rounds, args.lm_steps, args.lm_seq, args.lm_window = 1, 1, 64, 16
    passkey_finish(p, args)
    if not 0 <= args.margin < 1:
        p.error(f"--margin must be a fraction in [0, 1), got {args.margin}")
    if args.mmlu_test < 1:
        p.error(f"--mmlu-test must be at least 1, got {args.mmlu_test}")
    for algorithm in ("fednl", "fedala"):  # --fednl-overrides, --fedala-overrides
        flag, key = f"--{algorithm}-overrides", f"{algorithm}_overrides"
        try:
            setattr(args, key, shlex.split(getattr(args, key)))
        except ValueError as err:
            p.error(f"{flag}: {err}")
        if getattr(args, key) and not args.render:  # a typo fails here, not after other runs took an hour
            from fedapps.config import compose

            try:
                compose([*getattr(args, key), f"model={args.model}"], preset="fednl-cpu", algorithm=algorithm)
            except ValueError as err:  # ConfigError (an unknown key, a value out of range)
                p.error(f"{flag}: {err}")
    retrieval_finish(p, args)  # after --fednl-overrides is split
    args.niah_resume = Path(args.niah_resume) if args.niah_resume else None
    if args.niah_resume is not None and not args.niah_resume.is_dir():
        p.error(f"--niah-resume: no such folder {str(args.niah_resume)!r}")
    args.niah_from = Path(args.niah_from) if args.niah_from else None
    if args.niah_from is not None and not args.niah_from.is_file():
        p.error(f"--niah-from: no such file {str(args.niah_from)!r}")
    args.mmlu_from = [Path(x) for x in args.mmlu_from.split(",") if x]
    missing = [str(x) for x in args.mmlu_from if not x.is_file()]
    if missing:
        p.error(f"--mmlu-from: no such file {missing}")
    args.mmlu_add = [a for a in args.mmlu_add.split(",") if a]
    if args.mmlu_add and not args.mmlu_from:
        p.error("--mmlu-add adds runs to earlier ones: give them with --mmlu-from")
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    args.niah_lengths = [int(x) for x in args.niah_lengths.split(",")]
    args.niah_algorithms = [a for a in args.niah_algorithms.split(",") if a]
    if "fednl:meta-rules" not in args.niah_algorithms:
        p.error("--niah-algorithms needs fednl:meta-rules (what the others are compared with)")
    args.lm_algorithms = [a for a in args.lm_algorithms.split(",") if a]
    unknown = [a for a in args.lm_algorithms if a not in LM_ALGORITHMS]
    if unknown or not args.lm_algorithms:
        p.error(f"--lm-algorithms: each of {LM_ALGORITHMS}, got {unknown or 'none'}")
    if args.lm_window < 1 or args.lm_seq <= args.lm_window:
        p.error(f"--lm-window must be at least 1 and below --lm-seq ({args.lm_seq}), got {args.lm_window}")
    try:
        args.throughput_chunks = [int(x) for x in args.throughput_chunks.split(",") if x]
    except ValueError:
        p.error(f"--throughput-chunks must be a comma list of integers, got {args.throughput_chunks!r}")
    if any(c < 1 for c in args.throughput_chunks):
        p.error("--throughput-chunks must be positive")
    try:
        args.throughput_variants = [shlex.split(v) for v in args.throughput_variants.split(";") if v.strip()]
    except ValueError as err:
        p.error(f"--throughput-variants: {err}")
    if args.throughput_variants and not args.render:  # a typo fails here, not after the other models are built
        from fedapps.config import compose

        for variant in args.throughput_variants:
            try:
                compose([*variant, f"model={args.model}"], algorithm="fednl", task="mmlu")
            except ValueError as err:
                p.error(f"--throughput-variants {' '.join(variant)!r}: {err}")
    args.throughput_memory_heads = [m for m in args.throughput_memory_heads.split(",") if m]
    bad = [m for m in args.throughput_memory_heads if m not in ("query", "kv")]
    if bad:
        p.error(f"--throughput-memory-heads: each of query, kv, got {bad}")
    args.memory_lengths = [int(x) for x in args.memory_lengths.split(",")]
    if max(args.memory_lengths) > args.stream_length:
        p.error("--memory-lengths must not exceed --stream-length")
    if args.stream_length < 2048:
        p.error("--stream-length must be at least 2048 (two 1K bins for the relative CE)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.stream_worker:
        stream_worker(args.stream_worker)
        return
    if args.render:
        render(args)
        return
    command = f"python -m {MODULE} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out).expanduser().resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("stream_worker", "render")},
                     "command": command, "date": time.strftime("%Y-%m-%d")}
    start = time.time()
    timings = {}
    for section in SECTIONS:
        if section not in args.sections:
            continue
        t0 = time.time()
        if section == "mmlu":
            def saved(runs: dict) -> None:
                (out / "results.json").write_text(json.dumps({**results, "mmlu": runs}, indent=2, default=str))

            items = {}
            if args.mmlu_from:
                results["mmlu"], items = mmlu_from(args.mmlu_from)
                if args.mmlu_add:
                    earlier = dict(results["mmlu"])
                    added = section_mmlu(argparse.Namespace(**{**vars(args), "algorithms": args.mmlu_add}), out,
                                         lambda runs: saved({**earlier, **runs}))
                    for spec in added:  # a run added again replaces the earlier one and its scores
                        items.pop(spec, None)
                    results["mmlu"] = {**earlier, **added}
            else:
                results["mmlu"] = section_mmlu(args, out, saved)
            if args.paired:
                results["mmlu_paired"], items = mmlu_paired(args, out, results["mmlu"], items)
                results["mmlu_items"] = save_items(out, items)
        elif section == "niah":
            results["niah"], results["niah_paired"] = (niah_from(args.niah_from, args.niah_algorithms)
                                                       if args.niah_from else section_niah(args, out))
        elif section == "stream":
            if args.stream_from == "init":
                results["stream"] = section_stream(args, out, None)
            elif args.stream_from == "lm":
                if "lm" not in results:
                    results["lm"] = section_lm(args, out)
                results["stream"] = section_stream(args, out, results["lm"]["runs"], args.lm_algorithms)
            else:
                if "niah" not in results:
                    results["niah"], results["niah_paired"] = (niah_from(args.niah_from, args.niah_algorithms)
                                                               if args.niah_from else section_niah(args, out))
                results["stream"] = section_stream(args, out, results["niah"])
        elif section == "lm":
            results["lm"] = section_lm(args, out)
        elif section == "passkey":
            results["passkey"] = section_passkey(args, out)
        elif section == "retrieval":
            results["retrieval"] = section_retrieval(args, out)
        else:
            results["throughput"] = section_throughput(args)
        timings[section] = time.time() - t0
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    results["seconds"] = time.time() - start
    results["section_seconds"] = timings
    text = report(args, results, command)
    text += passkey_lines(results.get("passkey"))
    text += retrieval_lines(results.get("retrieval"))
    text += section_times(timings)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "fednl-bench.md").write_text(text)
    images = plots(results, out)
    print("\n" + text)
    if args.write_docs:
        docs_images = plots(results, ROOT / "docs")
        write_docs(text, docs_images)
    log(f"results in {out} ({', '.join(p.name for p in images)})")
