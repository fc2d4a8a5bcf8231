"""FedNL against the baselines on the embedded SmolLM2, sized for 2 CPU cores (<= 60 min).

    .venv/bin/python bench/fednl.py --write-docs            # the full CPU benchmark
    .venv/bin/python bench/fednl.py --quick --out /tmp/fednl-quick   # a pipeline check on the tiny model (alias --smoke)

Sections (``--sections``, all by default), each a real Flower simulation or measurement:

1. ``mmlu``: 5-client non-IID MMLU (one super-category per client) for fedavg-lora,
   fedprox, ffa-lora, fedala, fedssi and FedNL in both payload modes, ``--rounds`` rounds
   of ``--local-steps`` steps; per-client and average accuracy of the last round,
   uplink/downlink payload bytes per client per round, and the aggregation drop per client
   (the client's own model before aggregation vs the federated one, same round, same test
   questions; for the pairs that report it: FedNL, FedALA, FedSSI). ``fednl:ablate`` is FedNL's
   own ablation (the memory path off, everything else as in meta-rules mode). With
   ``--paired`` every final model and the untrained ones (round 0) are scored item by item on
   every client's held-out questions (``--mmlu-test`` per client; 700 gives 2,257) and
   compared paired (``postcard.compare``): each method against fedavg-lora (95% interval,
   McNemar, non-inferiority at ``--margin``), FedNL against its ablation, each method against
   its own round 0.
2. ``niah``: 7-client needle-in-a-haystack (one template per client), FedNL (softmax
   window ``--window``, the memory carries the rest), its ablation (the same window, memory
   off) and fedavg-lora (``--niah-algorithms``) trained on ``--niah-train-length``-token
   prompts, then every client's test prompts at ``--niah-lengths`` scored prompt by prompt
   with the final global model; FedNL paired against each of the others at every length.
3. ``stream``: one ``--stream-length``-token NIAH prompt streamed block by block through
   FedNL's recurrent form (and its ablation's) and through fedavg-lora's model (adapter merged
   into the backbone) with its KV cache, each in a fresh process: normalised CE per 1K-token bin
   relative to the first bin, and peak inference memory at ``--memory-lengths`` tokens
   (peak RSS above the loaded model; CUDA: allocator peak), with the carried state's bytes.
   Uses the ``niah`` section's trained models (the section runs it if needed), with
   ``--stream-from lm`` the ``lm`` section's (FedNL's window is then ``--lm-window``), or
   with ``--stream-from init`` the untrained ones (FedNL at init, the bare backbone).
4. ``throughput``: training tokens/s of FedNL (memory + LoRA q/k/v) vs plain LoRA on
   q/k/v with the same rank, same batch, interleaved timed steps.
5. ``lm``: what the memory adds where the softmax path cannot see: 4-client Shakespeare
   (one play each) on ``--lm-seq``-token windows, FedNL's softmax path limited to its 4
   sink tokens and the last ``--lm-window`` tokens; held-out loss window by window of the
   untrained backbone (full attention; the window without and with sinks), then of FedNL,
   its ablation (same window and sinks, memory off) and fedavg-lora (full attention) after
   ``--lm-rounds`` rounds; FedNL paired against its ablation, α per layer at the end.

Targets from the issue: FedNL's peak memory grows <= 1.1x from the first to the last
memory length; FedNL trains at >= 0.9x plain LoRA's tokens/s (issue #15; 0.7x before it). ``--write-docs`` puts the
tables (with the command that made them) into ``docs/fednl.md`` between its bench markers
and the plots into ``docs/fednl-*.png``; every run also leaves ``results.json`` and the
run folders under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

SECTIONS = ("mmlu", "niah", "lm", "stream", "throughput")
ALGORITHMS = ("fedavg-lora", "fedprox", "ffa-lora", "fedala", "fedssi", "fednl:meta-rules", "fednl:gate",
              "fednl:ablate")
NIAH_ALGORITHMS = ("fednl:meta-rules", "fednl:ablate", "fedavg-lora")
LM_ALGORITHMS = ("fednl:meta-rules", "fednl:ablate", "fedavg-lora")
MMLU_CLIENTS = ("law_ethics", "humanities", "stem", "math_cs", "medicine_psychology")
DOC_START, DOC_END = "<!-- bench:fednl:start -->", "<!-- bench:fednl:end -->"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--mmlu-from", default="",
                   help="comma list of results.json files of earlier MMLU runs (e.g. one algorithm each): their runs "
                        "are taken as this run's MMLU section instead of training (with --paired: compared together; "
                        "per-question scores a --paired run saved beside its results.json, in mmlu_items/, are "
                        "reused, so such a file needs no run folder)")
    p.add_argument("--fednl-overrides", default="",
                   help="Hydra overrides for FedNL's runs only (its modes and its ablation), e.g. "
                        "\"algorithm.lr.gate=0.05\"; checked before anything runs")
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
    if not 0 <= args.margin < 1:
        p.error(f"--margin must be a fraction in [0, 1), got {args.margin}")
    if args.mmlu_test < 1:
        p.error(f"--mmlu-test must be at least 1, got {args.mmlu_test}")
    try:
        args.fednl_overrides = shlex.split(args.fednl_overrides)
    except ValueError as err:
        p.error(f"--fednl-overrides: {err}")
    if args.fednl_overrides and not args.render:  # a typo fails here, not after other runs took an hour
        from fedapps.config import compose

        try:
            compose([*args.fednl_overrides, f"model={args.model}"], preset="fednl-cpu", algorithm="fednl")
        except ValueError as err:  # ConfigError (an unknown key, a value out of range)
            p.error(f"--fednl-overrides: {err}")
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
    args.memory_lengths = [int(x) for x in args.memory_lengths.split(",")]
    if max(args.memory_lengths) > args.stream_length:
        p.error("--memory-lengths must not exceed --stream-length")
    if args.stream_length < 2048:
        p.error("--stream-length must be at least 2048 (two 1K bins for the relative CE)")
    return args


# ---------------------------------------------------------------------------- helpers
def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def algorithm_overrides(spec: str, fednl_overrides=()) -> tuple[str, list[str]]:
    """'fednl:gate' -> ('fednl', ['algorithm.mode=gate']); 'fednl:ablate' -> FedNL's own ablation (meta-rules
    with the memory path off: algorithm.ablate_memory=true); 'fedala' -> ('fedala', [...caps]).
    ``fednl_overrides`` (``--fednl-overrides``) go to every FedNL run, its ablation included."""
    name, _, mode = spec.partition(":")
    overrides = []
    if name == "fednl" and mode == "ablate":
        overrides += ["algorithm.mode=meta-rules", "algorithm.ablate_memory=true"]
    elif name == "fednl":
        overrides.append(f"algorithm.mode={mode or 'meta-rules'}")
    elif mode:
        raise SystemExit(f"only fednl takes a mode, got '{spec}'")
    overrides.append("algorithm.eval_local=true")  # every method reports its aggregation drop
    if name == "fednl":
        overrides += list(fednl_overrides)
    if name == "fedala":  # the start phase: at most 2 passes of 4 batches on 2 cores
        overrides += ["algorithm.ala.max_batches=4", "algorithm.ala.max_start_epochs=2"]
    if name == "fedssi":
        overrides += ["algorithm.ssi.psm_steps=2"]
    return name, overrides


def run(cfg) -> dict:
    from fedapps.simulation import simulate

    start = time.time()
    summary = simulate(cfg)
    summary["bench_seconds"] = time.time() - start
    return summary


def common(args) -> list[str]:
    return [f"seed={args.seed}", f"train.lr={args.lr}", f"train.batch_size={args.batch_size}",
            "train.threads=1", "eval.batch_size=8"]


# ---------------------------------------------------------------------------- 1. MMLU
def section_mmlu(args, out: Path, saved=None) -> dict:
    """Each algorithm's run; ``saved(results)`` after each one (a stopped benchmark keeps the runs it
    finished, usable with ``--mmlu-from``)."""
    from fedapps.config import compose
    from fedapps.outputs import read_metrics

    results = {}
    for spec in args.algorithms:
        name, overrides = algorithm_overrides(spec, args.fednl_overrides)
        cfg = compose(
            [*common(args), *overrides, f"model={args.model}", f"rounds={args.rounds}",
             f"train.local_steps={args.local_steps}", f"eval.max_batches={args.eval_batches}",
             f"task.max_length={args.mmlu_max_length}", f"task.max_test={args.mmlu_test}", f"output_dir={out}",
             f"run_name=mmlu_{spec.replace(':', '-')}"],
            preset="fednl-cpu", algorithm=name,
        )
        log(f"MMLU: {spec}")
        summary = run(cfg)
        last = read_metrics(summary["run_dir"])[-1]
        per_client, drop = {}, {}
        for client in last["clients"]:
            pid = int(client["eval_partition-id"])
            per_client[MMLU_CLIENTS[pid]] = client["eval_accuracy"]
            if "train_local-accuracy" in client:
                drop[MMLU_CLIENTS[pid]] = client["train_local-accuracy"] - client["eval_accuracy"]
        results[spec] = {
            "per_client": per_client,
            "average": sum(per_client.values()) / len(per_client),
            "initial": summary["initial_metric"],
            "uplink_bytes": summary["uplink_bytes_per_client_round"],
            "downlink_bytes": summary["downlink_bytes_per_client_round"],
            "aggregation_drop": drop,
            "test_questions_per_client": last["clients"][0]["eval_num-examples"],
            "seconds": summary["bench_seconds"],
            "run_dir": summary["run_dir"],
        }
        log(f"MMLU {spec}: average {results[spec]['average']:.3f}, uplink {results[spec]['uplink_bytes']:,.0f} B, "
            f"{results[spec]['seconds']:.0f} s")
        if saved is not None:
            saved(results)
    return results


def mmlu_from(paths: list[Path]) -> tuple[dict, dict]:
    """The MMLU runs of earlier results.json files, merged in order (a later file's run of the same
    algorithm replaces an earlier one), and the per-question scores those files carry
    (``mmlu_items``: npz files beside them, written by ``--paired``). A run needs its run folder only
    where no scores of it were saved: a combined result (e.g. docs/bench/fednl/mmlu-paired.json with
    its mmlu_items/) is collected again in any checkout."""
    merged, items = {}, {}
    for path in paths:
        data = json.loads(path.read_text())
        runs = data.get("mmlu") or {}
        if not runs:
            raise SystemExit(f"--mmlu-from: {path} holds no MMLU runs")
        saved = load_items(path, data.get("mmlu_items") or {})
        for spec, r in runs.items():
            if spec not in saved and not (Path(r["run_dir"]) / "config.yaml").is_file():
                raise SystemExit(f"--mmlu-from: {spec}'s run folder {r['run_dir']} (from {path}) is gone and "
                                 "the file carries no per-question scores of it")
            merged[spec] = r
            items.pop(spec, None)
        items.update(saved)
    return merged, items


def item_file(name: str) -> str:
    """'fednl:meta-rules' -> 'fednl-meta-rules.npz'; 'round 0: fednl at init' -> 'round-0-fednl-at-init.npz'."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") + ".npz"


def save_items(out: Path, items: dict) -> dict:
    """Every scored model's per-question scores as ``out/mmlu_items/<name>.npz`` (compressed, ~20 kB
    each); returns the ``mmlu_items`` entry of results.json (name -> path relative to ``out``)."""
    import numpy as np

    folder = out / "mmlu_items"
    folder.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, scores in items.items():
        np.savez_compressed(folder / item_file(name), **{k: np.asarray(v) for k, v in scores.items()})
        index[name] = f"mmlu_items/{item_file(name)}"
    return index


def load_items(results: Path, index: dict) -> dict:
    """The scores :func:`save_items` listed, read from beside ``results`` (a missing file is an error)."""
    import numpy as np

    items = {}
    for name, rel in index.items():
        path = results.parent / rel
        if not path.is_file():
            raise SystemExit(f"--mmlu-from: {results} lists scores of {name} at {rel}, which is not there")
        with np.load(path) as saved:
            items[name] = {k: saved[k] for k in saved.files}
    return items


ROUND0 = {"backbone": "fedavg-lora", "fednl at init": "fednl:meta-rules"}  # the untrained models, built as these


def round0_of(spec: str) -> str:
    """The untrained model a run starts from: FedNL's memory at init (a = 0.018) for FedNL's payload
    modes; the bare backbone for every LoRA method and for FedNL's ablation (a = 0: the backbone, bit
    for bit, with LoRA's B = 0; tested in tests/test_fednl_app.py)."""
    return "fednl at init" if spec.startswith("fednl") and spec != "fednl:ablate" else "backbone"


def mmlu_paired(args, out: Path, mmlu: dict, items: dict | None = None) -> tuple[dict, dict]:
    """Every MMLU run's final model and the untrained ones, scored item by item on every client's
    held-out questions (``eval.max_batches=0``; kept as ``items-<key>.npz`` in each run folder), then
    paired: each method against fedavg-lora, FedNL's modes against its ablation and against every
    other baseline, each method's final model against its round 0 (how far it moved). ``items``: scores
    already at hand (from ``--mmlu-from``), not scored again. Returns the report and every score used."""
    from fedapps.config import from_yaml
    from fedapps.final import FinalModel, load_run

    items = dict(items or {})
    for spec, r in mmlu.items():
        if spec in items:
            continue
        final = load_run(r["run_dir"])
        final.cfg.eval.max_batches = 0  # every held-out question
        log(f"MMLU paired: scoring {spec} on every held-out question")
        items[spec] = final.items()
        del final
    for label, spec in ROUND0.items():
        if not any(round0_of(s) == label for s in mmlu) or f"round 0: {label}" in items:
            continue
        source = mmlu.get(spec) or next(r for s, r in mmlu.items() if round0_of(s) == label)
        cfg = from_yaml((Path(source["run_dir"]) / "config.yaml").read_text())
        cfg.eval.max_batches = 0
        model, tokenizer = load_trained(cfg, {})  # untrained: FedNL at init, or the bare backbone
        # under --out itself, not this run's dated folder: parts of one benchmark share the scores
        # (items-<key>.npz is keyed by the task, evaluation and partition settings and the seed)
        folder = Path(args.out).expanduser().resolve() / f"mmlu_round0_{label.replace(' ', '-')}"
        folder.mkdir(parents=True, exist_ok=True)
        log(f"MMLU paired: scoring the round-0 model ({label})")
        items[f"round 0: {label}"] = FinalModel(model, tokenizer, cfg, folder, {}).items()
        del model
    used = [*mmlu, *(f"round 0: {round0_of(s)}" for s in mmlu)]
    items = {k: v for k, v in items.items() if k in used}
    return paired_report(items, list(mmlu), args.margin), items


def paired_report(items: dict, specs: list, margin: float) -> dict:
    """The paired comparisons of :func:`mmlu_paired` from per-question scores: ``items`` maps each
    algorithm spec (and ``round 0: <label>``) to its scores (``postcard.compare`` format)."""
    import numpy as np

    from postcard.compare import compare, wilson

    result = {"margin": margin, "items": len(next(iter(items.values()))["index"])}
    if "fedavg-lora" in items:
        result["vs_fedavg_lora"] = compare({"fedavg-lora": items["fedavg-lora"],
                                            **{k: v for k, v in items.items() if k != "fedavg-lora"}},
                                           "fedavg-lora", "accuracy", margin=margin)
    if "fednl:ablate" in items:
        result["vs_ablation"] = compare({"fednl:ablate": items["fednl:ablate"],
                                         **{k: v for k, v in items.items() if k.startswith("fednl:") and
                                            k != "fednl:ablate"}}, "fednl:ablate", "accuracy", margin=margin)
    # FedNL against every other baseline (fedavg-lora is the table's own reference column)
    fednl_specs = [k for k in specs if k.startswith("fednl:") and k != "fednl:ablate"]
    result["fednl_vs_baselines"] = {
        base: compare({base: items[base], **{k: items[k] for k in fednl_specs}}, base, "accuracy", margin=margin)
        for base in specs if not base.startswith("fednl:") and base != "fedavg-lora"} if fednl_specs else {}
    result["moved"] = {spec: compare({"start": items[f"round 0: {round0_of(spec)}"], "final": items[spec]},
                                     "start", "accuracy", margin=margin)["runs"]["final"]
                       for spec in specs}
    result["accuracy"] = {name: {"accuracy": float(np.mean(r["correct"])),
                                 "ci95": wilson(int(np.sum(r["correct"] > 0.5)), len(r["correct"]))}
                          for name, r in items.items()}
    return result


def paired_lines(paired: dict) -> list[str]:
    margin = paired["margin"]
    lines = [f"### MMLU, paired on {paired['items']:,} held-out questions (every client's, never trained on)", "",
             "Accuracy with its 95% Wilson interval; against fedavg-lora the paired difference (95% interval), "
             f"McNemar's exact p and the one-sided non-inferiority p at a {margin * 100:g}-point margin "
             "(p < 0.05: not worse by that much); *moved* is the final model against its own round 0.", "",
             "| model | accuracy (95% CI) | Δ vs fedavg-lora (95% CI) | McNemar p | non-inferiority p | "
             "moved from round 0 (95% CI) | McNemar p |", "|---|---|---|---|---|---|---|"]
    versus = paired.get("vs_fedavg_lora", {}).get("runs", {})
    for name, acc in paired["accuracy"].items():
        row = f"| {name} | {acc['accuracy']:.3f} ({acc['ci95'][0]:.3f}..{acc['ci95'][1]:.3f}) | "
        d = versus.get(name, {}).get("accuracy_diff")
        row += (f"{d['mean'] * 100:+.1f} pp ({d['ci95'][0] * 100:+.1f}..{d['ci95'][1] * 100:+.1f}) | {d['p_value']:.3g} | "
                f"{d['noninferior_p']:.3g} | " if d else "— | — | — | ")
        m = paired["moved"].get(name, {}).get("accuracy_diff")
        row += (f"{m['mean'] * 100:+.1f} pp ({m['ci95'][0] * 100:+.1f}..{m['ci95'][1] * 100:+.1f}) | {m['p_value']:.3g} |"
                if m else "— | — |")
        lines.append(row)
    ablation = paired.get("vs_ablation", {}).get("runs", {})
    for name, r in ablation.items():
        d = r.get("accuracy_diff")
        if d:
            lines.append("")
            lines.append(f"{name} − its ablation (memory off): {d['mean'] * 100:+.1f} pp "
                         f"({d['ci95'][0] * 100:+.1f}..{d['ci95'][1] * 100:+.1f}), McNemar p {d['p_value']:.3g} "
                         f"({d['other_right_ref_wrong']} questions gained, {d['ref_right_other_wrong']} lost).")
    for base, cmp in paired.get("fednl_vs_baselines", {}).items():
        for name, r in cmp["runs"].items():
            d = r.get("accuracy_diff")
            if d:
                lines.append("")
                lines.append(f"{name} − {base}: {d['mean'] * 100:+.1f} pp ({d['ci95'][0] * 100:+.1f}.."
                             f"{d['ci95'][1] * 100:+.1f}), McNemar p {d['p_value']:.3g}, non-inferiority p "
                             f"{d['noninferior_p']:.3g} ({d['other_right_ref_wrong']} questions gained, "
                             f"{d['ref_right_other_wrong']} lost).")
    return lines + [""]


# ---------------------------------------------------------------------------- 2. NIAH
def niah_cfg(args, out: Path, spec: str, run_name: str):
    from fedapps.config import compose

    name, overrides = algorithm_overrides(spec, args.fednl_overrides)
    if name == "fednl":  # the window bounds the softmax path
        overrides.append(f"algorithm.memory.window={args.window}")
    overrides.append("algorithm.eval_local=false")  # no pre-aggregation scoring of 4K-token prompts, for any method
    lengths = ",".join(str(x) for x in args.niah_lengths)
    return compose(
        [*common(args), *overrides, f"model={args.model}", f"rounds={args.niah_rounds}", "num_clients=7",
         f"train.local_steps={args.niah_steps}", "train.batch_size=1",
         f"task.train_per_template={max(4, args.niah_rounds * args.niah_steps)}",  # no prompt trained on twice
         f"task.train_lengths=[{args.niah_train_length}]",
         f"task.test_per_template={args.niah_test_per_template}", f"task.test_lengths=[{lengths}]",
         "strategy.fraction_evaluate=0.0", f"output_dir={out}", f"run_name={run_name}"],
        task="niah", algorithm=name,
    )


def load_trained(cfg, summary: dict):
    """The final global model of a run (FedNL θ, or a PEFT adapter merged into the backbone);
    with no ``final_state``, the untrained one (FedNL at init, or the bare backbone)."""
    if summary.get("final_state") is None:
        from clients.models import build_model
        from fedapps.fednl import prepare

        model, tokenizer = prepare(cfg)[:2] if cfg.algorithm.name == "fednl" else build_model(cfg)
        return model.eval(), tokenizer
    if cfg.algorithm.name == "fednl":
        from fedapps.fednl import load_final

        model, tokenizer = load_final(cfg, summary["final_state"])
        return model, tokenizer
    from peft import PeftModel

    from clients.models import build_model

    base, tokenizer = build_model(cfg)
    model = PeftModel.from_pretrained(base, summary["final_state"]).merge_and_unload()
    return model.eval(), tokenizer


def spec_key(spec: str) -> str:
    """The NIAH, lm and stream result key of an algorithm spec: fednl, fednl-ablate, fedavg-lora."""
    return {"fednl:meta-rules": "fednl", "fednl:ablate": "fednl-ablate"}.get(spec, spec.replace(":", "-"))


def train_losses(run_dir) -> list[float]:
    """The clients' mean retrieval loss (the answer letter's cross-entropy over the full vocabulary): at
    the first step of round 1, then each round's training loss: whether training moved it at all."""
    import numpy as np

    from fedapps.outputs import read_metrics

    rounds = [r for r in read_metrics(run_dir) if any("train_loss" in c for c in r["clients"])]
    if not rounds:
        return []
    first = [c["train_first-loss"] for c in rounds[0]["clients"] if "train_first-loss" in c]
    means = [float(np.mean([c["train_loss"] for c in r["clients"] if "train_loss" in c])) for r in rounds]
    return ([float(np.mean(first))] if first else []) + means


def niah_result(scored: dict, summary: dict, train_seconds=None, eval_seconds=None) -> dict:
    """One NIAH run's entry of the results: accuracy per client (template) and per length, the counts,
    the retrieval loss by round, and where its model is."""
    import numpy as np

    lengths = sorted(int(x) for x in set(scored["length"].tolist()))
    templates = [str(t) for t in scored["template"]]
    return {
        "per_client": {templates[pid]: float(np.mean(scored["correct"][scored["client"] == pid]))
                       for pid in range(len(templates))},
        "per_length": {str(n): float(np.mean(scored["correct"][scored["length"] == n])) for n in lengths},
        "test_prompts_per_length": {str(n): int(np.sum(scored["length"] == n)) for n in lengths},
        "letter_loss": {str(n): float(np.mean(scored["loss"][scored["length"] == n])) for n in lengths},
        "alpha": summary.get("final_gate_alpha"),  # FedNL's gate per layer at the end (None for the others)
        "train_loss": train_losses(summary["run_dir"]),
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "run_dir": summary["run_dir"],
        "final_state": summary["final_state"],
    }


def resumed_niah(folder: Path) -> tuple[dict, dict]:
    """A finished and scored NIAH run folder (``--niah-resume``): its results entry and its items."""
    import numpy as np

    summary = json.loads((folder / "summary.json").read_text())
    summary["run_dir"] = str(folder.resolve())
    with np.load(folder / "niah_items.npz") as saved:
        scored = {k: saved[k] for k in saved.files}
    if "template" not in scored:  # saved before the templates were kept: the task's order, one per client
        from fedapps.config import from_yaml

        scored["template"] = np.asarray(list(from_yaml((folder / "config.yaml").read_text()).task.templates))
    return niah_result(scored, summary), {k: v for k, v in scored.items() if k != "template"}


def niah_from(path: Path, algorithms) -> tuple[dict, dict]:
    """The NIAH section of an earlier results.json (its run folders must still exist), for ``algorithms``."""
    earlier = json.loads(path.read_text())
    niah = earlier.get("niah") or {}
    missing = [spec for spec in algorithms if spec_key(spec) not in niah]
    if missing:
        raise SystemExit(f"--niah-from: {path} has no NIAH run of {missing} (it has {sorted(niah)})")
    for key, r in niah.items():
        if not (Path(r["run_dir"]) / "config.yaml").is_file():
            raise SystemExit(f"--niah-from: {key}'s run folder {r['run_dir']} (from {path}) is gone")
    return niah, earlier.get("niah_paired") or {}


def section_niah(args, out: Path) -> tuple[dict, dict]:
    """Each NIAH algorithm trained, then its final global model scored item by item on every
    client's test prompts (kept as ``niah_items.npz`` in its run folder); accuracy per length and,
    at each length, FedNL paired against its ablation and against fedavg-lora (McNemar)."""
    import numpy as np
    import torch

    from clients.tasks import make_task

    torch.set_num_threads(args.threads)
    results, items = {}, {}
    for spec in args.niah_algorithms:
        key = spec_key(spec)
        done = args.niah_resume / f"niah_{key}" if args.niah_resume else None
        if done is not None and (done / "niah_items.npz").is_file() and (done / "summary.json").is_file():
            results[key], items[key] = resumed_niah(done)
            log(f"NIAH {key}: taken from {done}: {results[key]['per_length']}")
            continue
        cfg = niah_cfg(args, out, spec, f"niah_{key}")
        log(f"NIAH: training {key} ({cfg.rounds} round(s), {cfg.train.local_steps} steps of "
            f"{args.niah_train_length}-token prompts per client)")
        summary = run(cfg)
        start = time.time()
        log(f"NIAH: scoring {key} on every client's test prompts")
        model, tokenizer = load_trained(cfg, summary)
        per_client, parts = {}, []
        for pid in range(7):
            task = make_task(cfg, pid, 7, tokenizer)
            scores = task.items(model, 1, 0)
            scores["client"] = np.full(len(scores["index"]), pid, dtype=np.int64)
            scores["length"] = np.asarray([task.length_of(int(i)) for i in scores["index"]], dtype=np.int64)
            per_client[task.templates[0]] = float(np.mean(scores["correct"]))
            parts.append(scores)
            log(f"NIAH {key}: client {pid + 1}/7 ({task.templates[0]}) scored on {len(scores['index'])} prompts, "
                f"accuracy {per_client[task.templates[0]]:.3f}, {(time.time() - start) / 60:.1f} min so far")
        scored = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
        scored["template"] = np.asarray(list(per_client))
        np.savez(Path(summary["run_dir"]) / "niah_items.npz", **scored)
        results[key] = niah_result(scored, summary, train_seconds=summary["bench_seconds"],
                                   eval_seconds=time.time() - start)
        items[key] = {k: v for k, v in scored.items() if k != "template"}
        log(f"NIAH {key}: {results[key]['per_length']}")
        del model
    return results, niah_paired(items, args.niah_lengths, args.margin)


def niah_paired(items: dict, lengths, margin: float) -> dict:
    """At each length, FedNL against its ablation and against fedavg-lora on the same prompts: the
    accuracy difference (McNemar) and the answer letter's cross-entropy, paired prompt by prompt."""
    from postcard.compare import compare

    paired = {}
    if "fednl" not in items:
        return paired
    for length in lengths:
        for ref in ("fednl-ablate", "fedavg-lora"):
            if ref not in items:
                continue
            sub = {name: {k: v[items[name]["length"] == length] for k, v in items[name].items()}
                   for name in (ref, "fednl")}
            if not len(sub[ref]["index"]):
                continue
            row = compare(sub, ref, "accuracy", margin=margin)["runs"]["fednl"]["accuracy_diff"]
            row["loss_diff"] = loss_diffs(sub, ref, ["fednl"]).get("fednl")
            paired.setdefault(str(length), {})[ref] = row
    return paired


# ---------------------------------------------------------------------------- 3. streams (worker + driver)
def stream_worker(spec_json: str) -> None:
    """In a fresh process: stream one long prompt, print one JSON line of results."""
    import torch

    from clients.fednl import FedNLStreamer, KVCacheStreamer, binned_nll, relative_ce, streamed_nll
    from clients.fednl.diagnostics import PeakMemory
    from clients.tasks.niah import make_example
    from fedapps.config import from_yaml

    spec = json.loads(spec_json)
    torch.set_num_threads(int(spec["threads"]))
    cfg = from_yaml(Path(spec["config"]).read_text())
    model, tokenizer = load_trained(cfg, {"final_state": spec["final_state"]})
    # one token more than the stream's length, so that every one of its tokens is scored
    example = make_example("passkey", int(spec["length"]) + 1, int(spec["seed"]), tokenizer)
    ids = torch.tensor([tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]])
    if spec["method"] == "fednl":
        def make():
            return FedNLStreamer(model, block=int(spec["block"]), form="recurrent")
    else:
        def make():
            return KVCacheStreamer(model, block=int(spec["block"]))
    streamed_nll(make(), ids[:, : int(spec["block"]) * 2])  # warm-up (kernels, allocator)
    lengths = [int(x) for x in spec["memory_lengths"]]
    peaks, states = {}, {}
    streamer = make()
    start = time.time()
    total = int(ids.shape[1])  # the prompt fits its target length, usually exactly
    with PeakMemory() as peak:
        def sample(done: int) -> None:
            for length in lengths:
                if (done >= length or done == total) and length not in peaks:
                    peaks[length] = peak.sample()
                    states[length] = streamer.state_bytes()

        nll = streamed_nll(streamer, ids, on_block=sample)
    result = {
        "method": spec["method"],
        "tokens": int(ids.shape[1]),
        "seconds": time.time() - start,
        "model_rss_bytes": peak.start,
        "peak_bytes": {str(k): v for k, v in peaks.items()},
        "state_bytes": {str(k): v for k, v in states.items()},
        "bins": binned_nll(nll, 1024) if nll.shape[1] >= 1024 else [],
        "relative_ce": relative_ce(nll, 1024) if nll.shape[1] >= 1024 else [],
        "measure": "peak RSS above the RSS with the model loaded",
    }
    print("RESULT " + json.dumps(result), flush=True)


def section_stream(args, out: Path, niah: dict | None, algorithms=None) -> dict:
    """Each model of ``niah`` (run folders by key: the NIAH or the lm section's) streamed in a fresh
    process, or with ``niah=None`` the untrained ones."""
    from fedapps.config import to_yaml

    results = {}
    for spec in algorithms or args.niah_algorithms:
        key = spec_key(spec)
        method = "fednl" if spec.startswith("fednl") else "kv"
        if niah is not None:
            config, final_state = str(Path(niah[key]["run_dir"]) / "config.yaml"), niah[key]["final_state"]
        else:  # untrained: FedNL at init with the window (its ablation: the windowed backbone), the bare backbone
            config, final_state = str(out / f"stream_{key}.yaml"), None
            Path(config).write_text(to_yaml(niah_cfg(args, out, spec, f"stream_{key}")))
        spec = {
            "method": method, "config": config, "final_state": final_state,
            "length": args.stream_length, "block": args.block, "seed": args.seed + 7,
            "memory_lengths": args.memory_lengths, "threads": args.threads,
        }
        log(f"stream: {key} ({'recurrent FedNL' if method == 'fednl' else 'KV cache'}), {args.stream_length} tokens")
        proc = subprocess.run([sys.executable, __file__, "--stream-worker", json.dumps(spec)],
                              capture_output=True, text=True, cwd=str(ROOT))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"stream worker for {key} failed:\n{proc.stderr[-3000:]}")
        results[key] = json.loads(lines[-1][len("RESULT "):])
        name = {"fednl": "FedNL recurrent", "fednl-ablate": "FedNL ablation (memory off) recurrent"}.get(
            key, f"{key} + KV cache" if niah is not None else "backbone + KV cache")
        results[key]["label"] = name + (" (at init)" if niah is None and method == "fednl" else "")
        log(f"stream {key}: {results[key]['seconds']:.0f} s, peak {results[key]['peak_bytes']}")
    return results


# ---------------------------------------------------------------------------- 4. throughput
def section_throughput(args) -> dict:
    import torch

    from fedapps import baselines, fednl
    from fedapps.config import compose

    torch.set_num_threads(args.threads)
    base = [f"model={args.model}", f"seed={args.seed}"]
    fednl_cfg = compose(base, algorithm="fednl", task="mmlu")
    lora_cfg = compose([*base, "algorithm.lora.target_modules=[q_proj,k_proj,v_proj]"], algorithm="fedavg-lora",
                       task="mmlu")
    chunk = int(fednl_cfg.algorithm.memory.chunk_size)
    models = {"fednl": fednl.prepare(fednl_cfg)[0], "lora-qkv": baselines.prepare(lora_cfg)[0]}
    for extra in (c for c in args.throughput_chunks if c != chunk):
        cfg = compose([*base, f"algorithm.memory.chunk_size={extra}"], algorithm="fednl", task="mmlu")
        models[f"fednl chunk {extra}"] = fednl.prepare(cfg)[0]
    vocab = models["fednl"].get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.throughput_batch, args.throughput_seq), generator=generator)
    optimizers = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for k, m in models.items()}

    def step(key: str) -> tuple[float, float]:
        """One training step: (wall seconds, CPU seconds of this process)."""
        model, optimizer = models[key], optimizers[key]
        wall, cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - wall, time.process_time() - cpu

    for key in models:  # warm-up
        step(key)
    times = {k: [] for k in models}
    for _ in range(args.throughput_steps):  # interleaved, so load changes hit both alike
        for key in models:
            times[key].append(step(key))
    tokens = args.throughput_batch * args.throughput_seq
    # wall-clock tokens/s, and tokens per CPU-second (robust to other load on a shared machine)
    rates = {k: tokens / (sum(w for w, _ in v) / len(v)) for k, v in times.items()}
    cpu_rates = {k: tokens / (sum(c for _, c in v) / len(v)) for k, v in times.items()}
    log(f"throughput: wall {rates}, per CPU-second {cpu_rates}")
    result = {"tokens_per_second": rates, "ratio": rates["fednl"] / rates["lora-qkv"],
              "tokens_per_cpu_second": cpu_rates, "cpu_ratio": cpu_rates["fednl"] / cpu_rates["lora-qkv"],
              "batch": args.throughput_batch, "seq": args.throughput_seq, "steps": args.throughput_steps,
              "chunk_size": chunk, "threads": args.threads,
              "trainable": {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in models.items()}}
    if args.throughput_profile:
        result["profile"] = step_profile({k: (lambda k=k: step(k)) for k in ("fednl", "lora-qkv")})
    return result


def step_profile(steps: dict, top: int = 14) -> dict:
    """Self CPU time per operator (ms per step, mean of 2 profiled steps) of each model's training step,
    and the operators where the first model spends the most beyond the second."""
    from torch.profiler import ProfilerActivity, profile

    per_op = {}
    for key, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            step()
        per_op[key] = {e.key: (e.self_cpu_time_total / 2e3, e.count // 2) for e in prof.key_averages()}
    first, second = list(per_op)
    extra = sorted(set(per_op[first]) | set(per_op[second]),
                   key=lambda op: per_op[second].get(op, (0, 0))[0] - per_op[first].get(op, (0, 0))[0])
    return {"models": [first, second],
            "total_ms": {k: sum(ms for ms, _ in ops.values()) for k, ops in per_op.items()},
            "ops": [{"op": op, **{k: per_op[k].get(op, (0.0, 0)) for k in (first, second)}} for op in extra[:top]]}


# ---------------------------------------------------------------------------- 5. language modelling past a window
def lm_cfg(args, out: Path, spec: str, run_name: str, **memory):
    """A 4-client Shakespeare run (one play each) on ``--lm-seq``-token windows; FedNL's softmax path
    sees its sinks and the last ``--lm-window`` tokens, the memory the rest (``memory``: overrides of
    algorithm.memory, e.g. ``sink=0``)."""
    from fedapps.config import compose

    name, overrides = algorithm_overrides(spec, args.fednl_overrides)
    if name == "fednl":
        overrides += [f"algorithm.memory.window={args.lm_window}", "algorithm.eval_local=false",
                      *(f"algorithm.memory.{k}={v}" for k, v in memory.items())]
    return compose(
        [*common(args), *overrides, f"model={args.model}", f"rounds={args.lm_rounds}", "num_clients=4",
         f"train.local_steps={args.lm_steps}", "train.batch_size=2", f"train.seq_len={args.lm_seq}",
         "eval.batch_size=2", "eval.max_batches=0", "strategy.fraction_evaluate=0.0",
         f"output_dir={out}", f"run_name={run_name}"],
        task="shakespeare", algorithm=name,
    )


def section_lm(args, out: Path) -> dict:
    """What the memory adds where the softmax path cannot see: held-out Shakespeare loss, window by
    window, of (a) the untrained backbone with full attention, with a ``--lm-window`` window and no
    sinks, and with the window and 4 sinks; (b) FedNL, its ablation (the same window and sinks,
    memory off) and fedavg-lora (full attention) after ``--lm-rounds`` federated rounds; FedNL paired
    against its ablation (paired t on the per-window losses), α per layer at the end."""
    import numpy as np
    import torch

    from fedapps.final import FinalModel, load_run

    torch.set_num_threads(args.threads)
    items, runs = {}, {}
    ablate = lm_cfg(args, out, "fednl:ablate", "lm_init")
    for label, cfg in (("backbone, full attention", lm_cfg(args, out, "fedavg-lora", "lm_init")),
                       (f"backbone, window {args.lm_window}, no sinks", lm_cfg(args, out, "fednl:ablate", "lm_init",
                                                                               sink=0)),
                       (f"backbone, window {args.lm_window} + {ablate.algorithm.memory.sink} sinks", ablate)):
        log(f"lm: scoring the untrained {label}")
        model, tokenizer = load_trained(cfg, {})
        folder = out / f"lm_init_{len(items)}"
        folder.mkdir(parents=True, exist_ok=True)
        items[f"init: {label}"] = FinalModel(model, tokenizer, cfg, folder, {}).items()
        del model
    for spec in args.lm_algorithms:
        key = spec_key(spec)
        cfg = lm_cfg(args, out, spec, f"lm_{key}")
        log(f"lm: training {key} ({cfg.rounds} round(s) of {cfg.train.local_steps} steps, {args.lm_seq}-token windows)")
        summary = run(cfg)
        final = load_run(summary["run_dir"])  # its config already scores every held-out window
        items[key] = final.items()
        alpha = summary.get("final_gate_alpha")
        runs[key] = {"run_dir": summary["run_dir"], "final_state": summary.get("final_state"),
                     "train_seconds": summary.get("bench_seconds"),
                     "uplink_bytes": summary.get("uplink_bytes_per_client_round"),
                     "train_loss": train_losses(summary["run_dir"]),
                     "alpha": None if alpha is None else [float(a) for a in np.ravel(alpha)]}
        del final
    losses = {name: float(np.mean(r["loss"])) for name, r in items.items()}
    result = {"window": args.lm_window, "seq": args.lm_seq, "windows": len(next(iter(items.values()))["loss"]),
              "rounds": args.lm_rounds, "steps": args.lm_steps, "loss": losses, "runs": runs}
    if "fednl-ablate" in items:
        result["vs_ablation"] = loss_diffs(items, "fednl-ablate", [k for k in items if k.startswith("fednl")
                                                                     and k != "fednl-ablate"])
    if "fedavg-lora" in items:
        result["vs_fedavg_lora"] = loss_diffs(items, "fedavg-lora", [k for k in items if k != "fedavg-lora"])
    return result


def loss_diffs(items: dict, ref: str, others: list) -> dict:
    """Each of ``others`` against ``ref``, paired item by item (``postcard.compare``'s loss_diff)."""
    from postcard.compare import compare

    runs = compare({ref: items[ref], **{k: items[k] for k in others}}, ref, "perplexity")["runs"]
    return {k: v["loss_diff"] for k, v in runs.items() if "loss_diff" in v}


def lm_lines(lm: dict) -> list[str]:
    import math

    import numpy as np

    lines = [f"### Language modelling past a {lm['window']}-token window (Shakespeare, 4 clients, "
             f"{lm['rounds']} rounds x {lm['steps']} steps)", "",
             f"Mean held-out loss (nats per token) over {lm['windows']} windows of {lm['seq']} tokens, every client's; "
             "Δ is paired window by window (95% t-interval, paired t p).", "",
             "| model | loss | perplexity | Δ vs FedNL's ablation (95% CI), p | Δ vs fedavg-lora (95% CI), p | α at the end |",
             "|---|---:|---:|---|---|---|"]

    def delta(d):
        return f"{d['mean']:+.4f} ({d['ci95'][0]:+.4f}..{d['ci95'][1]:+.4f}), p {d['p_value']:.3g}" if d else "—"

    for name, loss in lm["loss"].items():
        alpha = (lm["runs"].get(name) or {}).get("alpha")
        a = f"mean {np.mean(alpha):.3f}, max {np.max(alpha):.3f}" if alpha else "—"
        lines.append(f"| {name} | {loss:.4f} | {math.exp(min(loss, 50)):.2f} | "
                     f"{delta(lm.get('vs_ablation', {}).get(name))} | {delta(lm.get('vs_fedavg_lora', {}).get(name))} "
                     f"| {a} |")
    loss = lm["loss"]
    if {"fednl", "fednl-ablate", "fedavg-lora"} <= set(loss) and loss["fednl-ablate"] > loss["fedavg-lora"]:
        share = (loss["fednl-ablate"] - loss["fednl"]) / (loss["fednl-ablate"] - loss["fedavg-lora"])
        lines += ["", f"Share of the loss the window costs (FedNL's ablation → fedavg-lora with full attention) that "
                      f"the memory recovers: {share * 100:.0f}%" + (" (none: FedNL is behind its ablation)."
                                                                    if share < 0 else ".")]
    return lines + [""]


# ---------------------------------------------------------------------------- report
def label_of(key: str, stream_result: dict) -> str:
    return stream_result.get("label") or ("FedNL recurrent" if key == "fednl" else "fedavg-lora + KV cache")


def fmt_bytes(value) -> str:
    return "—" if value is None else f"{value:,.0f}"


def drop_interval(run: dict, questions: int) -> tuple[float, float, float]:
    """Mean aggregation drop over the clients (each scored on ``questions`` questions) and its 95%
    normal interval, unpaired: var = sum over clients of p(1-p)/n for the local and the federated
    accuracy, divided by the number of clients squared."""
    import math

    drops = [run["aggregation_drop"][c] for c in MMLU_CLIENTS]
    federated = [run["per_client"][c] for c in MMLU_CLIENTS]
    local = [f + d for f, d in zip(federated, drops)]
    variance = sum(p * (1 - p) / questions for p in (*federated, *local)) / len(drops) ** 2
    mean, half = sum(drops) / len(drops), 1.959964 * math.sqrt(variance)
    return mean, mean - half, mean + half


def run_date(results: dict) -> str:
    """The day a result was made: its own ``date``, else the newest dated run folder it names
    (``.../YYYYMMDD-HHMMSS/...``: results made before the date was recorded)."""
    if results.get("date"):
        return str(results["date"])
    stamps = re.findall(r"/(\d{4})(\d{2})(\d{2})-\d{6}(?:/|\b)", json.dumps(results, default=str))
    return "-".join(max(stamps)) if stamps else "date not recorded"


def report(args, results: dict, command: str) -> str:
    from postcard.compare import wilson

    lines = [f"Command: `{command}`", "",
             f"Model: {args.model}; seed {args.seed}; {run_date(results)}; "
             f"total {results.get('seconds', 0) / 60:.1f} min on this machine.", ""]
    mmlu = results.get("mmlu")
    if mmlu:
        q = next(iter(mmlu.values()))["test_questions_per_client"]
        lines += [f"### MMLU, 5 clients (one super-category each), {args.rounds} rounds x {args.local_steps} steps, "
                  f"{q} test questions per client", "",
                  "| algorithm | " + " | ".join(MMLU_CLIENTS) + " | average | round 0 | uplink B/client/round | "
                  "downlink B/client/round |",
                  "|---|" + "---:|" * (len(MMLU_CLIENTS) + 4)]
        for spec, r in mmlu.items():
            cells = [f"{r['per_client'].get(c, float('nan')):.3f}" for c in MMLU_CLIENTS]
            initial = "—" if r["initial"] is None else f"{r['initial']:.3f}"
            lines.append(f"| {spec} | " + " | ".join(cells) + f" | {r['average']:.3f} | {initial} | "
                         f"{fmt_bytes(r['uplink_bytes'])} | {fmt_bytes(r['downlink_bytes'])} |")
        lines += ["", "Aggregation drop (client's own model before aggregation minus the federated model, "
                      f"accuracy on the same {q} test questions per client, last round; positive = aggregation lost "
                      "accuracy). The 95% interval of the mean is over the pooled questions, unpaired (the clients "
                      "report accuracies, not answers: wider than a paired interval when the two models agree "
                      "on most questions):", "",
                  "| algorithm | " + " | ".join(MMLU_CLIENTS) + " | mean (95% CI) |",
                  "|---|" + "---:|" * (len(MMLU_CLIENTS) + 1)]
        for spec, r in mmlu.items():
            if r["aggregation_drop"]:
                drops = [r["aggregation_drop"].get(c) for c in MMLU_CLIENTS]
                mean, low, high = drop_interval(r, q)
                lines.append(f"| {spec} | " + " | ".join(f"{d:+.3f}" for d in drops) +
                             f" | {mean:+.3f} ({low:+.3f}..{high:+.3f}) |")
        lines.append("")
    if results.get("mmlu_paired"):
        lines += paired_lines(results["mmlu_paired"])
    niah = results.get("niah")
    if niah:
        lengths = [str(x) for x in args.niah_lengths]
        counts = next(iter(niah.values()))["test_prompts_per_length"]
        lines += [f"### NIAH, 7 clients (one template each), {args.niah_rounds} round(s) x {args.niah_steps} steps on "
                  f"{args.niah_train_length}-token prompts; accuracy of the final global model "
                  f"({', '.join(f'{counts[k]} prompts at {k}' for k in lengths if k in counts)})", "",
                  "Accuracy (95% Wilson interval) per test length; the train loss is the clients' mean cross-entropy "
                  "of the answer letter over the full vocabulary, at the first step and in the last round.", "",
                  "| algorithm | " + " | ".join(f"{x} tokens" for x in lengths) + " | train loss first → last "
                  "| α at the end |",
                  "|---|" + "---:|" * (len(lengths) + 2)]
        for name, r in niah.items():
            label = {"fednl": f"fednl (window {args.window})",
                     "fednl-ablate": f"fednl ablation, memory off (window {args.window})"}.get(name, name)
            cells = []
            for x in lengths:
                acc, n = r["per_length"].get(x), r["test_prompts_per_length"].get(x, 0)
                if acc is None or not n:
                    cells.append("—")
                    continue
                low, high = wilson(round(acc * n), n)
                cells.append(f"{acc:.3f} ({low:.2f}..{high:.2f})")
            loss = r.get("train_loss") or []
            trend = f"{loss[0]:.3f} → {loss[-1]:.3f}" if len(loss) > 1 else "—"
            alpha = r.get("alpha") if name != "fednl-ablate" else None  # the ablation's gate does nothing
            a = f"mean {sum(alpha) / len(alpha):.3f}, max {max(alpha):.3f}" if alpha else "—"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {trend} | {a} |")
        lines.append("")
        paired = results.get("niah_paired") or {}
        if paired:
            lines += ["FedNL paired against each reference on the same prompts (difference in accuracy, 95% interval, "
                      "McNemar's exact p; prompts FedNL got right and the reference wrong / the reverse; the "
                      "answer letter's cross-entropy, paired prompt by prompt, 95% t-interval):", "",
                      "| length | reference | FedNL − reference | McNemar p | gained / lost | letter CE, FedNL − reference |",
                      "|---:|---|---:|---:|---:|---:|"]
            for length, refs in paired.items():
                for ref, d in refs.items():
                    ce = d.get("loss_diff")
                    ce = f"{ce['mean']:+.4f} ({ce['ci95'][0]:+.4f}..{ce['ci95'][1]:+.4f})" if ce else "—"
                    lines.append(f"| {length} | {ref} | {d['mean'] * 100:+.1f} pp ({d['ci95'][0] * 100:+.1f}.."
                                 f"{d['ci95'][1] * 100:+.1f}) | {d['p_value']:.3g} | "
                                 f"{d['other_right_ref_wrong']} / {d['ref_right_other_wrong']} | {ce} |")
            lines.append("")
    stream = results.get("stream")
    if stream:
        lengths = [str(x) for x in args.memory_lengths]
        trained = {"niah": "the NIAH section's trained models", "lm": "the lm section's trained models"}.get(
            args.stream_from, "untrained models")
        lines += [f"### Streaming a {args.stream_length}-token NIAH prompt in blocks of {args.block} ({trained})", "",
                  "Peak inference memory above the loaded model (MB) at each context length, and the carried state:", "",
                  "| model | " + " | ".join(lengths) + f" | growth {lengths[0]}→{lengths[-1]} | carried state at {lengths[-1]} |",
                  "|---|" + "---:|" * (len(lengths) + 2)]
        for key, r in stream.items():
            peaks = [r["peak_bytes"].get(x) for x in lengths]
            growth = peaks[-1] / peaks[0] if peaks[0] else float("nan")
            lines.append(f"| {label_of(key, r)} | " + " | ".join(f"{p / 1e6:.1f}" for p in peaks) +
                         f" | {growth:.2f}x | {r['state_bytes'][lengths[-1]] / 1e6:.1f} MB |")
        lines += ["", f"Target: FedNL grows <= 1.1x from {lengths[0]} to {lengths[-1]} tokens.", "",
                  "Normalised cross-entropy per 1K-token bin relative to the first bin (% change; the last bin holds "
                  "the question and choices, so the second half's mean is the steadier figure):", "",
                  "| model | bins | second half vs first bin | last bin vs first bin |", "|---|---:|---:|---:|"]
        for key, r in stream.items():
            rel = r["relative_ce"]
            if len(rel) >= 2:
                half = rel[len(rel) // 2:]
                lines.append(f"| {label_of(key, r)} | {len(rel)} | {(sum(half) / len(half) - 1) * 100:+.1f}% | "
                             f"{(rel[-1] - 1) * 100:+.1f}% |")
        lines.append("")
    tp = results.get("throughput")
    if tp:
        rates = tp["tokens_per_second"]
        cpu = tp["tokens_per_cpu_second"]
        lines += [f"### Training throughput ({tp['batch']} x {tp['seq']} tokens, {tp['steps']} timed steps, "
                  f"{tp['threads']} threads, AdamW step included, chunk {tp['chunk_size']})", "",
                  "| model | trainable values | tokens/s (wall) | tokens per CPU-second |", "|---|---:|---:|---:|",
                  f"| FedNL (memory + LoRA q/k/v) | {tp['trainable']['fednl']:,} | {rates['fednl']:.1f} | {cpu['fednl']:.1f} |",
                  f"| plain LoRA q/k/v, same rank | {tp['trainable']['lora-qkv']:,} | {rates['lora-qkv']:.1f} | "
                  f"{cpu['lora-qkv']:.1f} |", "",
                  f"FedNL / plain LoRA = **{tp['ratio']:.2f}x** wall-clock, **{tp['cpu_ratio']:.2f}x** per CPU-second "
                  "(target >= 0.9x: " + ("met" if max(tp["ratio"], tp["cpu_ratio"]) >= 0.9 else "not met")
                  + "; on a shared machine the CPU-time ratio is the steadier one).", ""]
        chunks = [k for k in rates if k.startswith("fednl chunk")]
        if chunks:
            lines += ["Other chunk sizes of the training-time delta rule, timed in the same loop:", "",
                      "| model | tokens/s (wall) | tokens per CPU-second | / plain LoRA (CPU) |", "|---|---:|---:|---:|"]
            lines += [f"| FedNL, {k[6:]} | {rates[k]:.1f} | {cpu[k]:.1f} | {cpu[k] / cpu['lora-qkv']:.2f}x |"
                      for k in chunks]
            lines.append("")
        prof = tp.get("profile")
        if prof:
            a, b = prof["models"]
            lines += [f"Where the extra time goes: self CPU time per operator, ms per step (torch.profiler, 2 steps each; "
                      f"totals {prof['total_ms'][a]:,.0f} ms {a} vs {prof['total_ms'][b]:,.0f} ms {b}, profiler "
                      "overhead included), the operators with the largest difference:", "",
                      f"| operator | {a} ms (calls) | {b} ms (calls) | difference ms |", "|---|---:|---:|---:|"]
            for row in prof["ops"]:
                (ms_a, n_a), (ms_b, n_b) = row[a], row[b]
                lines.append(f"| `{row['op'][:60]}` | {ms_a:,.1f} ({n_a}) | {ms_b:,.1f} ({n_b}) | {ms_a - ms_b:+,.1f} |")
            lines.append("")
    if results.get("lm"):
        lines += lm_lines(results["lm"])
    return "\n".join(lines)


def plots(results: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    stream = results.get("stream")
    if not stream:
        return made
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, r in stream.items():
        if r["relative_ce"]:
            ax.plot(range(1, len(r["relative_ce"]) + 1), r["relative_ce"], marker="o", label=label_of(key, r))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="1K-token bin", ylabel="CE / CE of the first bin", title="Streaming cross-entropy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    made.append(folder / "fednl-stream-ce.png")
    fig.savefig(made[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, r in stream.items():
        xs = sorted(int(x) for x in r["peak_bytes"])
        ax.plot(xs, [r["peak_bytes"][str(x)] / 1e6 for x in xs], marker="o", label=label_of(key, r))
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context length (tokens)", ylabel="peak inference memory above the model (MB)",
           title="Peak inference memory")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    made.append(folder / "fednl-memory.png")
    fig.savefig(made[-1], dpi=120)
    plt.close(fig)
    return made


def write_docs(text: str, images: list[Path]) -> None:
    docs = ROOT / "docs" / "fednl.md"
    content = docs.read_text()
    if DOC_START not in content or DOC_END not in content:
        raise SystemExit(f"{docs} has no {DOC_START} ... {DOC_END} markers")
    refs = "\n".join(f"![{p.stem}]({p.name})" for p in images)
    head, rest = content.split(DOC_START, 1)
    _, tail = rest.split(DOC_END, 1)
    docs.write_text(f"{head}{DOC_START}\n{text}\n{refs}\n{DOC_END}{tail}")
    log(f"wrote {docs}")


def render(args) -> None:
    """Tables and plots of earlier runs (their results.json), one block per run, in order."""
    texts, images = [], []
    for path in args.render.split(","):
        results = json.loads(Path(path).read_text())
        run_args = argparse.Namespace(**results["args"])
        texts.append(report(run_args, results, results.get("command", "(command not recorded)")))
        if "section_seconds" in results:
            texts[-1] += "\nSection times: " + ", ".join(f"{k} {v / 60:.1f} min"
                                                         for k, v in results["section_seconds"].items()) + "\n"
        if results.get("stream"):
            images = plots(results, ROOT / "docs" if args.write_docs else Path(path).parent)
    text = "\n".join(texts)
    print(text)
    if args.write_docs:
        write_docs(text, images)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.stream_worker:
        stream_worker(args.stream_worker)
        return
    if args.render:
        render(args)
        return
    command = "python bench/fednl.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
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
        else:
            results["throughput"] = section_throughput(args)
        timings[section] = time.time() - t0
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    results["seconds"] = time.time() - start
    results["section_seconds"] = timings
    text = report(args, results, command)
    text += "\nSection times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) + "\n"
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "fednl-bench.md").write_text(text)
    images = plots(results, out)
    print("\n" + text)
    if args.write_docs:
        docs_images = plots(results, ROOT / "docs")
        write_docs(text, docs_images)
    log(f"results in {out} ({', '.join(p.name for p in images)})")


if __name__ == "__main__":
    main()
