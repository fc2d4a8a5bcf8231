"""Section 2, ``niah``: 7-client needle-in-a-haystack, each algorithm trained, then scored prompt by
prompt at every test length; an earlier run resumed (``--niah-resume``) or taken whole
(``--niah-from``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .runs import algorithm_overrides, common, load_trained, log, run, spec_key, train_losses
from .stats import niah_paired


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
