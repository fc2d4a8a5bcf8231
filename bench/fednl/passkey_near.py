"""Where FedNL's windowed ablation (memory off) still retrieves the passkey: keys 10-200 tokens from the end.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.fednl.passkey_near --out docs/bench/fednl/passkey-near.json

16 held-out ``task=passkey`` prompts of 384 tokens (8 per filler) with the needle at depth 0.45-1.0 and no
minimum distance, scored by exact match by the untrained backbone with full attention and by the ablation
with a 32, 64 and 128-token window + 4 sinks: each prompt's key distance (tokens from the needle's end to the
prompt's end) and hit per model. The ``passkey`` section keeps every key beyond the window; this one shows
the window itself works (keys inside it are found) and where the ablation falls to chance.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .runs import load_trained, log


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fednl.passkey_near", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", default="32,64,128")
    p.add_argument("--per-filler", type=int, default=8)
    p.add_argument("--length", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="the JSON report")
    args = p.parse_args(argv)
    import torch

    from clients.tasks import make_task
    from fedapps.config import compose

    torch.set_num_threads(args.threads)
    windows = [int(w) for w in args.windows.split(",")]
    common = [f"model={args.model}", "seed=42", "num_clients=1", "task.train_per_filler=1",
              f"task.train_lengths=[{args.length}]", f"task.test_per_filler={args.per_filler}",
              f"task.test_lengths=[{args.length}]", "task.depth=[0.45,1.0]"]
    full = compose([*common, "task.min_distance=0"], task="passkey", algorithm="fedavg-lora")
    # (FedNL's configs need a min_distance above the window; the prompts come from `full`'s task)
    specs = [("full attention", full)] + [
        (f"window {w} + 4 sinks, memory off",
         compose([*common, f"task.min_distance={w + 1}", "algorithm.mode=meta-rules", "algorithm.ablate_memory=true",
                  f"algorithm.memory.window={w}", "algorithm.memory.sink=4"], task="passkey", algorithm="fednl"))
        for w in windows]
    backbone, tokenizer = load_trained(full, {})
    task = make_task(full, 0, 1, tokenizer)
    rows = [(int(i), int(task.example(int(i))["distance"])) for i in task.test_idx]
    out = {"model": args.model, "length": args.length, "distance": [d for _, d in rows], "correct": {}}
    for label, cfg in specs:
        model = backbone if label == "full attention" else load_trained(cfg, {})[0]
        start = time.time()
        with torch.no_grad():
            out["correct"][label] = [float(task.item_scores(model, task.collate([i]))["correct"][0]) for i, _ in rows]
        log(f"{label}: {sum(out['correct'][label]):.0f}/{len(rows)} exact, {time.time() - start:.0f} s")
    Path(args.out).write_text(json.dumps(out, indent=1))
    for label, hits in out["correct"].items():
        print(f"{label}: found at distances {[d for d, h in sorted(zip(out['distance'], hits)) if h]}, "
              f"missed at {[d for d, h in sorted(zip(out['distance'], hits)) if not h]}")


if __name__ == "__main__":
    main()
