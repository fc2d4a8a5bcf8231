"""Section ``retrieval``: passkey retrieval past the window after federated training (issue #44,
items 3 and 4), the comparison the ``passkey`` section's bounds prepare.

For each seed of ``--retrieval-seeds`` and each algorithm of ``--retrieval-algorithms`` — FedNL
(its softmax path limited to ``--retrieval-window`` tokens and ``--passkey-sink`` sinks), FedNL's
ablation (the same window, memory off: LoRA on q/k/v at FedNL's bytes, the byte-matched windowed
baseline) and fedavg-lora with full attention (the upper bound) — a federated run on
``task=passkey`` (clients by filler, ``--retrieval-train-length``-token prompts), then its final
global model scored prompt by prompt on every held-out prompt of that seed (``--passkey-prompts`` per
length, the key ≥ ``--passkey-min-distance`` tokens back; ``--retrieval-split val`` scores the
validation prompts instead, for tuning). Reported: exact match per model, length and seed; FedNL
against its ablation and against the others, McNemar per seed and combined over seeds (the
discordant pairs pooled); the share of the gap between the ablation and full attention FedNL
recovers; FedNL's gate α per layer after every round (``metrics.jsonl``: is the memory used at all?).
Targets (issue #44): FedNL ≥ its ablation + 20 pp with p < 0.01, and at least half the gap recovered.
Each scored run keeps ``retrieval_items.npz`` in its folder; ``--retrieval-resume FOLDER`` takes the
runs of an earlier (stopped) invocation that were scored, and trains only the others. ``--retrieval-keep
FOLDER`` also writes each scored run's record (its row and per-prompt scores, no weights: small enough to
commit) and takes a run from its record when its folder is gone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .runs import algorithm_overrides, load_trained, log, run, spec_key

ALGORITHMS = ("fednl:meta-rules", "fednl:ablate", "fedavg-lora")
ROUND0 = "fednl:round0"  # the no-training arm: FedNL at init (the same window), scored without a round
TARGET_GAIN, TARGET_P, TARGET_SHARE = 0.20, 0.01, 0.5


def add_arguments(p) -> None:
    p.add_argument("--retrieval-algorithms", default=",".join(ALGORITHMS),
                   help="retrieval: FedNL (windowed), its ablation (same window, memory off), fedavg-lora "
                        "(full attention)")
    p.add_argument("--retrieval-window", type=int, default=64, help="retrieval: FedNL's softmax window (+ sinks)")
    p.add_argument("--retrieval-seeds", default="42", help="retrieval: comma list of seeds (>= 3 for the comparison)")
    p.add_argument("--retrieval-rounds", type=int, default=3)
    p.add_argument("--retrieval-steps", type=int, default=10, help="retrieval: local steps per round (1 prompt each)")
    p.add_argument("--retrieval-clients", type=int, default=2, help="retrieval: clients (natural split: by filler)")
    p.add_argument("--retrieval-train-length", type=int, default=512, help="retrieval: training prompt tokens")
    p.add_argument("--retrieval-split", choices=("test", "val"), default="test",
                   help="retrieval: score the test prompts, or the validation ones (tuning)")
    p.add_argument("--retrieval-resume", default="",
                   help="retrieval: an earlier run folder: its scored runs are taken, only the others train")
    p.add_argument("--retrieval-keep", default="",
                   help="retrieval: a folder that keeps each scored run's record (its row and per-prompt scores, "
                        "a few KB; no weights) and is resumed from when the run folders are gone")
    p.add_argument("--retrieval-local-prompts", type=int, default=0,
                   help="retrieval: the aggregation drop: each client scores its freshly trained model on its "
                        "first K held-out prompts in the last round (algorithm.eval_local=last), the final global model is "
                        "scored on the same prompts (0: off)")


def finish_args(p, args) -> None:
    if args.smoke:
        args.retrieval_rounds, args.retrieval_steps, args.retrieval_train_length = 1, 1, 256
        args.retrieval_window = 16
    try:
        args.retrieval_seeds = [int(x) for x in str(args.retrieval_seeds).split(",") if x]
    except ValueError:
        p.error("--retrieval-seeds must be a comma list of integers")
    args.retrieval_algorithms = [a for a in str(args.retrieval_algorithms).split(",") if a]
    unknown = [a for a in args.retrieval_algorithms if a not in (*ALGORITHMS, ROUND0)]
    if unknown or not args.retrieval_algorithms or not args.retrieval_seeds:
        p.error(f"--retrieval-algorithms: any of {(*ALGORITHMS, ROUND0)} (FedNL is paired with the others when it "
                f"is among them), and at least one seed; got {args.retrieval_algorithms}")
    args.retrieval_lrs = {}  # a learning rate per result key (bench.fednl.retrieval_protocol); --lr otherwise
    if args.passkey_min_distance <= args.retrieval_window:
        p.error(f"--passkey-min-distance ({args.passkey_min_distance}) must exceed --retrieval-window "
                f"({args.retrieval_window}): the key must lie beyond the softmax window")
    if args.retrieval_train_length <= args.passkey_min_distance:
        p.error("--retrieval-train-length must exceed --passkey-min-distance")
    if args.retrieval_local_prompts < 0:
        p.error("--retrieval-local-prompts must be >= 0")
    args.retrieval_resume = Path(args.retrieval_resume) if args.retrieval_resume else None
    if args.retrieval_resume is not None and not args.retrieval_resume.is_dir():
        p.error(f"--retrieval-resume: no such folder {str(args.retrieval_resume)!r}")
    args.retrieval_keep = Path(args.retrieval_keep) if args.retrieval_keep else None


def lr_of(args, key: str) -> float:
    """A result key's learning rate: its own (``args.retrieval_lrs``, set by bench.fednl.retrieval_protocol)
    or ``--lr``."""
    return getattr(args, "retrieval_lrs", {}).get(key, args.lr)


def retrieval_cfg(args, out: Path, spec: str, seed: int, *, scoring: bool = False):
    """The training run of ``spec`` (clients by filler), or with ``scoring`` one client holding every
    held-out prompt of the seed (the same prompts for every algorithm: they are seeded by split, seed,
    filler and index)."""
    from fedapps.config import compose

    name, overrides = algorithm_overrides("fednl:meta-rules" if spec == ROUND0 else spec)
    local = 0 if scoring or spec == ROUND0 else getattr(args, "retrieval_local_prompts", 0)
    overrides = [o for o in overrides if o != "algorithm.eval_local=true"] + [
        f"algorithm.eval_local={'last' if local else 'false'}", *([f"eval.max_batches={local}"] if local else [])]
    if name == "fednl":
        overrides += [f"algorithm.memory.window={args.retrieval_window}", f"algorithm.memory.sink={args.passkey_sink}",
                      *args.fednl_overrides]
    clients = 1 if scoring else args.retrieval_clients
    fillers = args.passkey_fillers
    held_out = args.passkey_prompts // len(fillers) * len(args.passkey_lengths)
    per_filler = max(2, args.retrieval_rounds * args.retrieval_steps * max(1, clients // len(fillers)) + 1)
    split = args.retrieval_split
    lengths = ",".join(str(x) for x in args.passkey_lengths)
    return compose(
        [*overrides, f"model={args.model}", f"seed={seed}",
         f"train.lr={lr_of(args, spec_key(spec))}", "train.batch_size=1",
         "train.threads=1", "eval.batch_size=1", f"rounds={args.retrieval_rounds}", f"num_clients={clients}",
         f"train.local_steps={args.retrieval_steps}", f"task.fillers=[{','.join(fillers)}]",
         f"task.train_per_filler={per_filler}", f"task.train_lengths=[{args.retrieval_train_length}]",
         f"task.{split}_per_filler={held_out}", f"task.{split}_lengths=[{lengths}]", f"task.eval_split={split}",
         f"task.min_distance={args.passkey_min_distance}", "strategy.fraction_evaluate=0.0",
         f"output_dir={out}", f"run_name=retrieval_{spec_key(spec)}_s{seed}"],
        task="passkey", algorithm=name)


def gate_by_round(run_dir) -> tuple[list[list[float]], list[int] | None]:
    """FedNL's global gate α per layer after every round (the server's record in metrics.jsonl), and the
    layer index of each α (None for runs recorded before ``gate_layers`` was kept)."""
    from fedapps.outputs import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("gate_alpha")]
    layers = [r["gate_layers"] for r in rows if r.get("gate_layers")]
    return [list(r["gate_alpha"]) for r in rows], (list(layers[-1]) if layers else None)


def aggregation_drop(args, out: Path, spec: str, seed: int, summary: dict, trained=None) -> dict | None:
    """Each client's freshly trained model of the last round (its ``local-accuracy`` / ``local-loss`` on its
    first ``--retrieval-local-prompts`` held-out prompts, recorded before aggregation) against the final
    global model scored on the same prompts (the client's task, the same evaluation settings); kept as
    ``aggregation_drop.json`` in the run's folder. None for the untrained arm. ``trained``: the final model
    and tokenizer, when the caller has them loaded."""
    from clients.tasks import make_task
    from clients.train import evaluate
    from fedapps.outputs import read_metrics

    if spec == ROUND0:
        return None
    path = Path(summary["run_dir"]) / "aggregation_drop.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = [c for c in read_metrics(summary["run_dir"])[-1]["clients"] if "train_local-accuracy" in c]
    if not rows:
        raise RuntimeError(f"{summary['run_dir']}: no client scored its local model (algorithm.eval_local)")
    cfg = retrieval_cfg(args, out, spec, seed)
    model, tokenizer = trained or load_trained(cfg, summary)
    clients = {}
    for row in sorted(rows, key=lambda c: int(c["train_partition-id"])):
        pid = int(row["train_partition-id"])
        scored = evaluate(model, make_task(cfg, pid, int(cfg.num_clients), tokenizer), cfg.eval)
        clients[str(pid)] = {"local_accuracy": float(row["train_local-accuracy"]),
                             "global_accuracy": float(scored["accuracy"]),
                             "local_loss": float(row["train_local-loss"]), "global_loss": float(scored["loss"]),
                             "prompts": int(scored["num-examples"])}
    drop = {"clients": clients, "prompts": int(args.retrieval_local_prompts)}
    path.write_text(json.dumps(drop, indent=1))
    return drop


def score(args, out: Path, spec: str, seed: int, summary: dict, trained) -> dict:
    """Every held-out prompt of the seed through the run's final global model, kept as
    ``retrieval_items.npz`` in its folder: ``correct``, ``loss``, ``index``, ``length``, ``client``."""
    import numpy as np

    from clients.tasks import make_task

    cfg = retrieval_cfg(args, out, spec, seed, scoring=True)
    model, tokenizer = trained  # (the run's final model, load_trained)
    task = make_task(cfg, 0, 1, tokenizer)
    items = task.items(model, 1, 0)
    items["length"] = np.asarray([task.length_of(int(i)) for i in items["index"]], dtype=np.int64)
    items["client"] = np.zeros(len(items["index"]), dtype=np.int64)
    items = {k: v for k, v in items.items() if k in ("correct", "loss", "index", "length", "client")}
    np.savez(Path(summary["run_dir"]) / "retrieval_items.npz", **items)
    return items


ITEM_KEYS = {"correct": float, "loss": float, "index": int, "length": int, "client": int}


def record_path(keep: Path, key: str, seed) -> Path:
    """Where ``--retrieval-keep`` keeps the record of result key ``key``'s run on ``seed``."""
    return Path(keep) / f"retrieval_{key}_s{seed}.json"


def write_record(path: Path, row: dict, items: dict, **extra) -> None:
    """A scored run's record: its row of ``retrieval.json`` and its per-prompt scores (``ITEM_KEYS``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**extra, "row": row, "items": {k: [ITEM_KEYS[k](v) for v in items[k]] for k in ITEM_KEYS}}
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")


def read_record(path: Path) -> tuple[dict, dict, dict]:
    """(row, per-prompt scores as arrays, the record's other fields) of a kept record."""
    import numpy as np

    try:
        record = json.loads(path.read_text())
        items = {k: np.asarray(record["items"][k], dtype=np.float64 if kind is float else np.int64)
                 for k, kind in ITEM_KEYS.items()}
        if len({len(v) for v in items.values()}) != 1 or not isinstance(record["row"], dict):
            raise ValueError("its per-prompt scores differ in length")
    except (ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"{path}: not a retrieval record ({err!r}); remove it to train and score that run again")
    return record["row"], items, {k: v for k, v in record.items() if k not in ("row", "items")}


def section_retrieval(args, out: Path) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    result = {"algorithms": args.retrieval_algorithms, "seeds": args.retrieval_seeds, "window": args.retrieval_window,
              "sink": args.passkey_sink, "lengths": args.passkey_lengths, "split": args.retrieval_split,
              "min_distance": args.passkey_min_distance, "model": args.model, "rounds": args.retrieval_rounds,
              "steps": args.retrieval_steps, "clients": args.retrieval_clients,
              "train_length": args.retrieval_train_length, "runs": {}}
    items: dict[str, dict[str, dict]] = {}
    for seed in args.retrieval_seeds:
        for spec in args.retrieval_algorithms:
            key, trained = spec_key(spec), None  # trained: the final model and tokenizer, once loaded
            earlier = args.retrieval_resume / f"retrieval_{key}_s{seed}" if args.retrieval_resume else None
            kept = record_path(args.retrieval_keep, key, seed) if args.retrieval_keep else None
            if kept is not None and kept.is_file() and not (earlier and (earlier / "retrieval_items.npz").is_file()):
                row, scored, extra = read_record(kept)
                items.setdefault(str(seed), {})[key] = scored
                result["runs"].setdefault(str(seed), {})[key] = {**row, **extra}
                log(f"retrieval {key}, seed {seed}: taken from its record {kept}")
                continue
            if earlier is not None and (earlier / "retrieval_items.npz").is_file():
                summary = {**json.loads((earlier / "summary.json").read_text()), "run_dir": str(earlier.resolve())}
                with np.load(earlier / "retrieval_items.npz") as saved:
                    scored = {k: saved[k] for k in saved.files}
                log(f"retrieval {key}, seed {seed}: taken from {earlier}")
            else:
                cfg = retrieval_cfg(args, out, spec, seed)
                stopped = out / f"retrieval_{key}_s{seed}"
                if stopped.is_dir() and not (stopped / "retrieval_items.npz").is_file():
                    # a run stopped before it was scored: set aside, so this one takes the folder's name
                    stopped.rename(out / f"{stopped.name}.stopped-{time.strftime('%Y%m%d-%H%M%S')}")
                if spec == ROUND0:  # no training: the untrained model, scored into a folder of its own
                    summary = {"final_state": None, "run_dir": str(out / f"retrieval_{key}_s{seed}")}
                    Path(summary["run_dir"]).mkdir(parents=True, exist_ok=True)
                    (Path(summary["run_dir"]) / "summary.json").write_text(json.dumps(summary))
                else:
                    log(f"retrieval: training {key}, seed {seed} ({cfg.rounds} rounds x {cfg.train.local_steps} "
                        f"steps of {args.retrieval_train_length}-token prompts, {cfg.num_clients} clients, "
                        f"lr {cfg.train.lr:g})")
                    summary = run(cfg)
                start = time.time()
                trained = load_trained(cfg, summary)
                scored = score(args, out, spec, seed, summary, trained)
                log(f"retrieval {key}, seed {seed}: {int(np.sum(scored['correct'] > 0.5))}/{len(scored['correct'])} "
                    f"exact ({time.time() - start:.0f} s scoring)")
            items.setdefault(str(seed), {})[key] = scored
            drop = aggregation_drop(args, out, spec, seed, summary, trained) if args.retrieval_local_prompts else None
            trained_fednl = spec.startswith("fednl") and spec != ROUND0
            alphas, layers = gate_by_round(summary["run_dir"]) if trained_fednl else (None, None)
            result["runs"].setdefault(str(seed), {})[key] = {
                "per_length": {str(n): [int(np.sum(scored["correct"][scored["length"] == n] > 0.5)),
                                        int(np.sum(scored["length"] == n))] for n in args.passkey_lengths},
                "answer_loss": {str(n): float(np.mean(scored["loss"][scored["length"] == n]))
                                for n in args.passkey_lengths if np.any(scored["length"] == n)},
                "gate_alpha_by_round": alphas,
                "gate_layers": layers,
                "lr": None if spec == ROUND0 else float(lr_of(args, key)),
                "uplink_bytes_per_client_round": summary.get("uplink_bytes_per_client_round"),
                "aggregation_drop": drop,
                "run_dir": summary["run_dir"]}
            if kept is not None:
                write_record(kept, result["runs"][str(seed)][key], scored)
            (out / "retrieval.json").write_text(json.dumps(result, indent=2))
    result["paired"] = paired(items, args.passkey_lengths)
    (out / "retrieval.json").write_text(json.dumps(result, indent=2))
    return result


def paired(items: dict[str, dict[str, dict]], lengths) -> dict:
    """FedNL against each other model at each length: per seed McNemar (``postcard.compare``), and over
    seeds the discordant pairs pooled (an exact binomial test), the accuracy difference, and for the
    ablation the share of the ablation → full-attention gap FedNL recovers."""
    import numpy as np

    from postcard.compare import compare
    from postcard.stats import mcnemar_p

    out: dict = {}
    others = sorted({k for runs in items.values() for k in runs} - {"fednl"})
    for length in lengths:
        for ref in others:
            per_seed, gains, losses, diffs, n = {}, 0, 0, [], 0
            for seed, runs in items.items():
                if "fednl" not in runs or ref not in runs:
                    continue
                sub = {name: {k: v[runs[name]["length"] == length] for k, v in runs[name].items()}
                       for name in (ref, "fednl")}
                if not len(sub[ref]["index"]):
                    continue
                row = compare(sub, ref, "accuracy")["runs"]["fednl"]["accuracy_diff"]
                per_seed[seed] = row
                gains += row["other_right_ref_wrong"]
                losses += row["ref_right_other_wrong"]
                diffs.append(row["mean"] * len(sub[ref]["index"]))
                n += len(sub[ref]["index"])
            if not per_seed:
                continue
            p = mcnemar_p(gains, losses)
            out.setdefault(str(length), {})[ref] = {"per_seed": per_seed, "diff": float(np.sum(diffs) / n),
                                                    "gained": gains, "lost": losses, "p_value": p, "prompts": n}
        if "fednl-ablate" in out.get(str(length), {}) and "fedavg-lora" in out.get(str(length), {}):
            acc = {name: float(np.mean(np.concatenate([runs[name]["correct"][runs[name]["length"] == length]
                                                       for runs in items.values() if name in runs])))
                   for name in ("fednl", "fednl-ablate", "fedavg-lora")}
            gap = acc["fedavg-lora"] - acc["fednl-ablate"]
            out[str(length)]["recovered"] = {"accuracy": acc, "share": (acc["fednl"] - acc["fednl-ablate"]) / gap
                                             if gap > 0 else None}
    return out


def drop_summary(result: dict) -> dict:
    """The aggregation drop (a client's local model − the global model on the client's own prompts) of every
    trained model, pooled over seeds and clients: exact match (pp) and answer CE, each with its 95% t
    interval; and FedNL's drop − each other model's, paired by (seed, client)."""
    import numpy as np

    from .stats import t_interval

    drops: dict[str, dict[tuple, tuple[float, float]]] = {}
    for seed, runs in result["runs"].items():
        for key, scored in runs.items():
            for client, c in ((scored.get("aggregation_drop") or {}).get("clients") or {}).items():
                drops.setdefault(key, {})[(seed, client)] = (100 * (c["local_accuracy"] - c["global_accuracy"]),
                                                             c["local_loss"] - c["global_loss"])
    out: dict = {}
    for key, by in drops.items():
        if len(by) < 2:
            continue
        pp, ce = np.asarray(list(by.values())).T
        out[key] = {"pp": t_interval(pp), "ce": t_interval(ce), "pairs": len(by)}
    for key, by in drops.items():
        shared = sorted(set(by) & set(drops.get("fednl", {})))
        if key == "fednl" or len(shared) < 2:
            continue
        d = np.asarray([np.subtract(drops["fednl"][k], by[k]) for k in shared]).T
        out.setdefault("fednl_minus", {})[key] = {"pp": t_interval(d[0]), "ce": t_interval(d[1]),
                                                  "pairs": len(shared)}
    return out


def retrieval_lines(result: dict | None) -> str:
    """The section's markdown: exact match per model, length and seed; FedNL paired; the targets; α."""
    if not result:
        return ""
    lengths = [str(n) for n in result["lengths"]]
    lines = ["", f"### Passkey retrieval after federated training ({result['model']}, {result['clients']} clients, "
                 f"{result['rounds']} rounds x {result['steps']} steps of {result['train_length']}-token prompts; "
                 f"FedNL and its ablation: window {result['window']} + {result['sink']} sinks; key >= "
                 f"{result['min_distance']} tokens back; {result['split']} prompts)", "",
             "| model | seed | " + " | ".join(f"{n} tokens" for n in lengths) + " | answer CE (nats/token) |",
             "|---|---:|" + "---:|" * len(lengths) + "---|"]
    for seed, runs in result["runs"].items():
        for key, r in runs.items():
            loss = r.get("answer_loss") or {}  # (runs scored before it was recorded have none)
            lines.append(f"| {key} | {seed} | " + " | ".join(
                f"{r['per_length'][n][0]}/{r['per_length'][n][1]}" for n in lengths) + " | "
                + (", ".join(f"{loss[n]:.3f}" for n in lengths if n in loss) or "–") + " |")
    lines += ["", "(answer CE: the answer tokens' mean cross-entropy; with SmolLM2's tokenizer a space and 5 "
                  "digits, so guessing the digits uniformly, the space known, gives (ln 9 + 4 ln 10) / 6 = 1.90)"]
    for length, refs in (result.get("paired") or {}).items():
        lines += ["", f"FedNL paired at {length} tokens (discordant pairs pooled over seeds, exact binomial):", ""]
        for ref, row in refs.items():
            if ref == "recovered":
                continue
            lines.append(f"- vs {ref}: {100 * row['diff']:+.1f} pp over {row['prompts']} prompts "
                         f"({row['gained']} gained, {row['lost']} lost, p {row['p_value']:.2g})")
        ablation, recovered = refs.get("fednl-ablate"), refs.get("recovered")
        if ablation:
            met = ablation["diff"] >= TARGET_GAIN and ablation["p_value"] < TARGET_P
            lines.append(f"- target FedNL ≥ ablation + {100 * TARGET_GAIN:.0f} pp, p < {TARGET_P}: "
                         f"**{'met' if met else 'not met'}**")
        if recovered and recovered["share"] is not None:
            lines.append(f"- share of the ablation → full-attention gap recovered: {recovered['share']:.0%} "
                         f"(target ≥ {TARGET_SHARE:.0%}: **{'met' if recovered['share'] >= TARGET_SHARE else 'not met'}**)")
    drops = drop_summary(result)
    if drops:
        prompts = next(r["aggregation_drop"]["prompts"] for runs in result["runs"].values() for r in runs.values()
                       if r.get("aggregation_drop"))
        lines += ["", f"Aggregation drop: each client's last local model − the final global model, on the client's "
                      f"first {prompts} held-out prompts; over seeds × clients, 95% t:", "",
                  "| model | (seed, client) pairs | exact match drop (pp) | answer CE drop (nats) |", "|---|---:|---|---|"]

        def cell(x):
            return f"{x['mean']:+.3f} ({x['ci95'][0]:+.3f}..{x['ci95'][1]:+.3f})"

        for key, row in drops.items():
            if key != "fednl_minus":
                lines.append(f"| {key} | {row['pairs']} | {cell(row['pp'])} | {cell(row['ce'])} |")
        for key, row in (drops.get("fednl_minus") or {}).items():
            lines.append(f"| FedNL − {key} (paired) | {row['pairs']} | {cell(row['pp'])} | {cell(row['ce'])} |")
    for seed, runs in result["runs"].items():
        alphas = (runs.get("fednl") or {}).get("gate_alpha_by_round")
        if alphas:
            layers = (runs.get("fednl") or {}).get("gate_layers") or list(range(len(alphas[0])))
            lines += ["", f"FedNL's gate α per layer after each round (seed {seed}):", "",
                      "| round | " + " | ".join(f"L{i}" for i in layers) + " |",
                      "|---:|" + "---:|" * len(alphas[0])]
            lines += [f"| {r} | " + " | ".join(f"{a:.3f}" for a in row) + " |" for r, row in enumerate(alphas, 1)]
    return "\n".join(lines) + "\n"
