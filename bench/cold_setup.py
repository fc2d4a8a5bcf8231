"""Where a cold ClientApp message's setup goes: each step timed in a fresh Python process.

    .venv/bin/python bench/cold_setup.py                  # SmolLM2 + fedavg-lora on Shakespeare: a first and 3 later processes
    .venv/bin/python bench/cold_setup.py --quick          # the tiny Llama: a first and 1 later process

A stock Flower deployment starts a new ``flwr-clientapp`` process for every message (docs/deploy.md
§9): it imports Flower and Postcard's ClientApp (torch, transformers and peft with it), composes the
run's config, builds the model with the method's adapters, and prepares the client's task data,
before it trains. This runs those steps in order in ``--repeats`` fresh processes and prints each
step's seconds: what ``postcard.worker`` (one long-lived process per node) saves per message,
and what the cheaper cold path cuts. The first process starts with an empty partition cache (a
client's first message: it imports flwr-datasets to draw its partition); the later ones read their
indices from it (``clients.partition.cached_partition``), as every later message of a cold
deployment does; the table has both. Process start, FAB install and Flower's messaging
are not in it (``bench/overhead.py`` measures whole rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
t = [time.perf_counter()]
import flwr  # noqa: F401
from fedapps import client_app  # noqa: F401  Postcard's ClientApp and what it imports at the top
import torch, transformers, peft  # noqa: F401,E401  the heavy imports (those not yet done above)
t.append(time.perf_counter())
from fedapps.config import compose
cfg = compose(sys.argv[1].split(), algorithm=sys.argv[2])
t.append(time.perf_counter())
from fedapps import registry
method = registry.get(str(cfg.algorithm.name))
model, tokenizer, extra = method.prepare(cfg)
t.append(time.perf_counter())
from clients.tasks import make_task
task = make_task(cfg, 0, int(cfg.num_clients), tokenizer)
t.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(t, t[1:])]))
"""
STEPS = ("imports (flwr, the ClientApp, torch, transformers, peft)", "compose the config",
         "model + the method's adapters", "the client's task data")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", default="shakespeare")
    p.add_argument("--algorithm", default="fedavg-lora")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="later messages (fresh processes) after the first")
    p.add_argument("--quick", action="store_true", help="the tiny Llama, one later process")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.repeats = "tiny-llama", 1
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    overrides = f"model={args.model} task={args.task} num_clients={args.clients}"
    cache = tempfile.mkdtemp(prefix="postcard-partitions-")  # empty: the first process draws the partition
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "POSTCARD_PARTITION_CACHE": cache}
    runs = []
    for i in range(args.repeats + 1):
        out = subprocess.run([sys.executable, "-c", CHILD, overrides, args.algorithm], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        which = "first (empty partition cache)" if i == 0 else f"later {i}/{args.repeats}"
        print(f"process {which}: " + ", ".join(f"{s:.1f} s" for s in runs[-1]), flush=True)
    first, later = runs[0], runs[1:]
    load = os.getloadavg()[0]
    print(f"\n{args.algorithm} on {args.task} with {args.model} ({args.clients} clients), a client's first message "
          f"and the median of {args.repeats} later ones, each a fresh process, {time.strftime('%Y-%m-%d')}, "
          f"load average {load:.1f} on {os.cpu_count()} cores:\n")
    print("| step | first message, s | later messages, s |\n|---|---:|---:|")
    for k, step in enumerate(STEPS):
        print(f"| {step} | {first[k]:.1f} | {statistics.median(r[k] for r in later):.1f} |")
    print(f"| total | {sum(first):.1f} | {statistics.median(sum(r) for r in later):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
