"""Section 1, ``mmlu``: 5-client non-IID MMLU for each algorithm, earlier runs taken from their
results.json (``--mmlu-from``), and with ``--paired`` every final and round-0 model scored item by
item (the scores kept beside results.json, in mmlu_items/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .runs import MMLU_CLIENTS, ROUND0, algorithm_overrides, common, load_trained, log, round0_of, run
from .stats import paired_report


def section_mmlu(args, out: Path, saved=None) -> dict:
    """Each algorithm's run; ``saved(results)`` after each one (a stopped benchmark keeps the runs it
    finished, usable with ``--mmlu-from``)."""
    from fedapps.config import compose
    from fedapps.outputs import read_metrics

    results = {}
    for spec in args.algorithms:
        name, overrides = algorithm_overrides(spec, args.fednl_overrides, args.fedala_overrides)
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
            "overrides": overrides,  # the algorithm's own (its mode, caps, --fednl-/--fedala-overrides)
        }
        if name == "fedala":  # did its weights move (with η = 1 they did not: docs/fednl.md)
            from fedapps.fedala import ala_weights_by_round
            from fedapps.outputs import read_metrics

            results[spec]["ala_weights"] = ala_weights_by_round(read_metrics(summary["run_dir"]))
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
