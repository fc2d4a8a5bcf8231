"""Section ``passkey``: the bounds of the retrieval comparison, before any training.

The same held-out passkey prompts (``task=passkey``: a 5-digit key in filler text, at least
``--passkey-min-distance`` tokens before the prompt's end) scored prompt by prompt by the untrained
backbone with full attention (the upper bound: what fedavg-lora starts from) and by FedNL's ablation
(memory off, α = 0 exactly: ``algorithm.ablate_memory=true``) with its softmax path limited to
``--passkey-sink`` sink tokens and the last W tokens, for each W of ``--passkey-windows`` (the lower
bound: what the window alone retrieves). Exact match of the key under teacher forcing (= greedy
decoding), per model and prompt length, and by the key's distance from the prompt's end: stacked
windowed layers reach about layers x W tokens back, so where the ablation really falls to chance is
measured, not assumed. Lengths outer, models inner; the results so far are saved after every cell
(``passkey.json`` under the run folder), so a stopped run keeps what it measured.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .runs import load_trained, log

DISTANCE_BINS = (0, 256, 512, 1024, 2048, 4096)


def add_arguments(p) -> None:
    p.add_argument("--passkey-lengths", default="512,1024,2048", help="passkey: prompt lengths (tokens)")
    p.add_argument("--passkey-windows", default="32,64,128", help="passkey: FedNL ablation's softmax windows")
    p.add_argument("--passkey-sink", type=int, default=4, help="passkey: sink tokens the windowed path keeps")
    p.add_argument("--passkey-prompts", type=int, default=20,
                   help="passkey: held-out prompts per length (split evenly over the fillers)")
    p.add_argument("--passkey-fillers", default="grass,shakespeare", help="passkey: filler sources")
    p.add_argument("--passkey-min-distance", type=int, default=160,
                   help="passkey: tokens between the key and the prompt's end, at least (above every window)")


def finish_args(p, args) -> None:
    """Parse and check the passkey flags (``p.error`` on a bad one); ``--quick`` sizes."""
    if args.smoke:
        args.passkey_lengths, args.passkey_windows, args.passkey_prompts = "256,320", "16,32", 4
        args.passkey_min_distance = 64
    try:
        args.passkey_lengths = [int(x) for x in str(args.passkey_lengths).split(",") if x]
        args.passkey_windows = [int(x) for x in str(args.passkey_windows).split(",") if x]
    except ValueError:
        p.error("--passkey-lengths and --passkey-windows must be comma lists of integers")
    args.passkey_fillers = [f for f in str(args.passkey_fillers).split(",") if f]
    from clients.tasks.passkey import FILLERS

    if not args.passkey_fillers or set(args.passkey_fillers) - set(FILLERS):
        p.error(f"--passkey-fillers: each of {FILLERS}, got {args.passkey_fillers}")
    if not args.passkey_lengths or not args.passkey_windows or min(args.passkey_windows) < 1:
        p.error("--passkey-lengths and --passkey-windows must list positive integers")
    if args.passkey_min_distance <= max(args.passkey_windows):
        p.error(f"--passkey-min-distance ({args.passkey_min_distance}) must exceed every window "
                f"({max(args.passkey_windows)}): the key must lie beyond the softmax window")
    if min(args.passkey_lengths) <= args.passkey_min_distance:
        p.error("--passkey-lengths must exceed --passkey-min-distance")
    if args.passkey_prompts < len(args.passkey_fillers) or args.passkey_prompts % len(args.passkey_fillers):
        p.error(f"--passkey-prompts must be a positive multiple of the {len(args.passkey_fillers)} fillers")


def passkey_cfg(args, algorithm: str, window: int | None = None):
    """One client holding every held-out prompt (``n`` per length per filler, all lengths)."""
    from fedapps.config import compose

    per_filler = args.passkey_prompts // len(args.passkey_fillers) * len(args.passkey_lengths)
    lengths = ",".join(str(x) for x in args.passkey_lengths)
    overrides = [f"model={args.model}", f"seed={args.seed}", "num_clients=1",
                 f"task.fillers=[{','.join(args.passkey_fillers)}]", "task.train_per_filler=1",
                 f"task.train_lengths=[{min(args.passkey_lengths)}]", f"task.test_per_filler={per_filler}",
                 f"task.test_lengths=[{lengths}]", f"task.min_distance={args.passkey_min_distance}"]
    if algorithm == "fednl":  # FedNL's own ablation: memory off (a = 0 exactly), the softmax path windowed
        overrides += ["algorithm.mode=meta-rules", "algorithm.ablate_memory=true", f"algorithm.memory.window={window}",
                      f"algorithm.memory.sink={args.passkey_sink}"]
    return compose(overrides, task="passkey", algorithm=algorithm)


def models(args) -> list[tuple[str, object]]:
    """(label, config) of every model scored: full attention, then each window's ablation."""
    out = [("full attention", passkey_cfg(args, "fedavg-lora"))]
    out += [(f"window {w} + {args.passkey_sink} sinks, memory off", passkey_cfg(args, "fednl", w))
            for w in args.passkey_windows]
    return out


def section_passkey(args, out: Path) -> dict:
    import torch

    from clients.tasks import make_task

    torch.set_num_threads(args.threads)
    specs = models(args)
    loaded = {label: load_trained(cfg, {}) for label, cfg in specs}
    task = make_task(specs[0][1], 0, 1, loaded[specs[0][0]][1])
    prompts = []
    for i in task.test_idx:
        ex = task.example(int(i))
        prompts.append({"index": int(i), "length": int(ex["length_tokens"]), "filler": ex["filler"],
                        "distance": int(ex["distance"]), "depth": float(ex["depth"]), "key": ex["key"]})
    result = {"lengths": args.passkey_lengths, "windows": args.passkey_windows, "sink": args.passkey_sink,
              "fillers": args.passkey_fillers, "min_distance": args.passkey_min_distance, "model": args.model,
              "layers": int(getattr(loaded[specs[0][0]][0].config, "num_hidden_layers", 0)),
              "prompts": prompts, "correct": {}, "token_accuracy": {}, "loss": {}, "seconds": {},
              "load_average": [list(os.getloadavg())]}
    start = time.time()
    for length in args.passkey_lengths:
        rows = [k for k, p in enumerate(prompts) if p["length"] == length]
        for label, _ in specs:
            model = loaded[label][0]
            t0 = time.time()
            scores = {"correct": [], "token_accuracy": [], "loss": []}
            with torch.no_grad():
                for k in rows:
                    s = task.item_scores(model, task.collate([prompts[k]["index"]]))
                    for name in scores:
                        scores[name].append(float(s[name][0]))
            for name in scores:
                result[name].setdefault(label, {})[str(length)] = scores[name]
            result["seconds"].setdefault(label, {})[str(length)] = time.time() - t0
            log(f"passkey {length} tokens, {label}: {int(sum(scores['correct']))}/{len(rows)} exact, "
                f"{time.time() - t0:.0f} s ({(time.time() - start) / 60:.1f} min so far, load "
                f"{os.getloadavg()[0]:.1f})")
            result["load_average"].append(list(os.getloadavg()))
            (out / "passkey.json").write_text(json.dumps(result, indent=2))
    result["summary"] = summarize(result)
    (out / "passkey.json").write_text(json.dumps(result, indent=2))
    del loaded
    return result


def summarize(result: dict) -> dict:
    """Exact-match counts per model and length, and per model by the key's distance from the end."""
    summary = {"per_length": {}, "per_distance": {}}
    prompts = result["prompts"]
    by_length = {str(n): [k for k, p in enumerate(prompts) if p["length"] == n] for n in result["lengths"]}
    for label, cells in result["correct"].items():
        summary["per_length"][label] = {n: [int(sum(v)), len(v)] for n, v in cells.items()}
        bins = {}
        for n, values in cells.items():
            for k, hit in zip(by_length[n], values):
                d = prompts[k]["distance"]
                lo = max(b for b in DISTANCE_BINS if b <= d)
                hi = min([b for b in DISTANCE_BINS if b > d] or [d + 1])
                cell = bins.setdefault(f"{lo}-{hi}", [0, 0])
                cell[0] += int(hit)
                cell[1] += 1
        summary["per_distance"][label] = dict(sorted(bins.items(), key=lambda kv: int(kv[0].split("-")[0])))
    return summary


def passkey_lines(result: dict | None) -> str:
    """The section's markdown: exact match per model and length, then by the key's distance."""
    if not result:
        return ""
    summary = result.get("summary") or summarize(result)
    lengths = [str(n) for n in result["lengths"]]
    lines = ["", f"### Passkey retrieval bounds, untrained {result['model']} ({result.get('layers', '?')} layers): "
                 f"exact match of the 5-digit key (teacher forcing = greedy), fillers {', '.join(result['fillers'])}, "
                 f"key >= {result['min_distance']} tokens before the prompt's end", "",
             "| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for label, cells in summary["per_length"].items():
        lines.append(f"| {label} | " + " | ".join(
            f"{cells[n][0]}/{cells[n][1]} ({cells[n][0] / cells[n][1]:.0%})" if n in cells else "—"
            for n in lengths) + " |")
    bins = sorted({b for cells in summary["per_distance"].values() for b in cells}, key=lambda b: int(b.split("-")[0]))
    lines += ["", "By the key's distance from the prompt's end (tokens), all lengths together:", "",
              "| model | " + " | ".join(bins) + " |", "|---|" + "---:|" * len(bins)]
    for label, cells in summary["per_distance"].items():
        lines.append(f"| {label} | " + " | ".join(f"{cells[b][0]}/{cells[b][1]}" if b in cells else "—"
                                                for b in bins) + " |")
    load = result.get("load_average") or []
    if load:
        lines += ["", f"Load average (1 min) while it ran: {min(x[0] for x in load):.1f}..{max(x[0] for x in load):.1f} "
                      f"(2 cores)."]
    return "\n".join(lines) + "\n"
