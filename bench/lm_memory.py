"""Client peak memory and speed of causal-LM local training, full logits vs the chunked output layer.

    .venv/bin/python bench/lm_memory.py                       # fedavg-lora, flite, fednl on SmolLM2, ~6 min
    .venv/bin/python bench/lm_memory.py --quick               # tiny-llama, seconds
    .venv/bin/python bench/lm_memory.py --methods fedavg-lora --chunks 0 64 256
    .venv/bin/python bench/lm_memory.py --methods smartfed --variants bf16 bf16+ckpt   # + the frozen backbone in bf16
    .venv/bin/python bench/lm_memory.py --methods smartfed --smartfed-overrides "algorithm.downlink=int4"

Each (method, ``train.logit_chunk``) runs in a fresh process (``bench/memory.py``, the probe
bench/smartfed.py uses too): the method's ``prepare`` builds the client's model (SmolLM2-135M
with the method's adapters), then ``--steps`` local AdamW steps on the first Shakespeare
client's windows (``--batch-size`` × ``--seq-len`` tokens). Reported per row: the process's
peak resident memory while training (Linux ``VmHWM``, reset once the model is built), the
part of it above the loaded model, seconds per step (the first step included), and the
ratio of peak memory to the same method with the full logits (chunk 0) and to fedavg-lora's
(always measured: the reference of the memory target). ``--variants`` adds the backbone
stored in bfloat16 (``train.frozen_bf16``) and/or activation checkpointing
(``train.grad_checkpointing``), with the chunked output layer. SmartFed's client gets the
round-1 downlink of the model's pool (``--pool``); ``--smartfed-overrides`` are Hydra overrides
of SmartFed's rows only (e.g. a tuned setting; fedavg-lora, the reference, stays as configured).
``train.logit_chunk`` (default 256) runs the output layer and the loss on that many tokens
at a time, recomputed in backward, so the [batch, tokens, 49,152] logits never exist.
Writes ``OUT/lm_memory.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memory import measure_memory  # noqa: E402 (bench/memory.py)

METHODS = ("fedavg-lora", "flite", "fednl", "smartfed")
# variant -> overrides: how the client stores and runs the backbone
VARIANTS = {
    "fp32": [],
    "bf16": ["train.frozen_bf16=true"],
    "ckpt": ["train.grad_checkpointing=true"],
    "bf16+ckpt": ["train.frozen_bf16=true", "train.grad_checkpointing=true"],
}
REFERENCE = ("fedavg-lora", 0, "fp32")  # every row's second ratio: fedavg-lora, full logits, fp32


def measure(method: str, chunk: int, variant: str, args) -> dict:
    from fedapps.config import compose

    overrides = [f"train.logit_chunk={chunk}", f"train.batch_size={args.batch_size}", f"train.seq_len={args.seq_len}",
                 "train.threads=1", "train.progress_seconds=0", *VARIANTS[variant]]
    if args.quick:
        overrides.append("model=tiny-llama")
    downlink = None
    if method == "smartfed":  # a client of round 1: the experts and routers the server sends (the model's pool)
        overrides += shlex.split(args.smartfed_overrides)
        if args.pool:
            overrides.append(f"algorithm.pool={args.pool}")
        cfg = compose(overrides, algorithm=method, task="shakespeare", preset="none")
        overrides.append(f"num_clients={cfg.task.default_clients}")  # the server's plan needs the count
        cfg = compose(overrides, algorithm=method, task="shakespeare", preset="none")
        from smartfed import round1_downlink  # bench/smartfed.py

        downlink = round1_downlink(cfg)
    cfg = compose(overrides, algorithm=method, task="shakespeare", preset="none")
    return measure_memory(cfg, args.workdir, args.steps, downlink, name=f"{method}-chunk{chunk}-{variant}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(METHODS[:3]), choices=list(METHODS))
    p.add_argument("--chunks", nargs="+", type=int, default=[0, 256], help="train.logit_chunk values (0 = full logits)")
    p.add_argument("--variants", nargs="+", default=["fp32"], choices=list(VARIANTS),
                   help="how the backbone is stored and run: " + "; ".join(
                       f"{k}: {' '.join(v) or 'as configured'}" for k, v in VARIANTS.items()))
    p.add_argument("--steps", type=int, default=3, help="local steps measured (peak memory and s/step)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--pool", default=None, help="SmartFed's knowledge pool (default: the model's, postcard pool build)")
    p.add_argument("--smartfed-overrides", default="",
                   help="Hydra overrides for SmartFed's rows only, e.g. 'algorithm.downlink=int4'")
    p.add_argument("--quick", action="store_true", help="tiny-llama instead of SmolLM2 (seconds)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "lm_memory")
    args = p.parse_args(argv)
    if args.smartfed_overrides:  # a typo fails here, not after the reference rows have run for minutes
        from fedapps.config import compose

        try:
            compose(shlex.split(args.smartfed_overrides), algorithm="smartfed", task="shakespeare", preset="none")
        except ValueError as err:  # ConfigError, or shlex's unbalanced quotes
            p.error(f"--smartfed-overrides: {err}")
    args.workdir = Path(tempfile.mkdtemp(prefix="lm-memory-"))
    if 0 not in args.chunks:
        args.chunks = [0, *args.chunks]  # the reference of every ratio
    if "fp32" not in args.variants:
        args.variants = ["fp32", *args.variants]
    command = "bench/lm_memory.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    jobs = [(m, c, v) for m in dict.fromkeys([REFERENCE[0], *args.methods]) for v in args.variants for c in args.chunks
            if v == "fp32" or c != 0]  # variants with the chunked output layer only
    rows = []
    for method, chunk, variant in jobs:
        print(f"[bench {time.strftime('%H:%M:%S')}] {method}, train.logit_chunk={chunk}, {variant}", flush=True)
        rows.append({"method": method, "logit_chunk": chunk, "variant": variant,
                     **measure(method, chunk, variant, args)})
        print(f"    peak {rows[-1]['peak_rss_mb']:,.0f} MB, {rows[-1]['seconds_per_step']:.2f} s/step", flush=True)
    text = report(rows, command, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_memory.md").write_text(text)
    results = {"command": command, "smartfed_overrides": args.smartfed_overrides, "rows": rows}
    (args.out / "lm_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    return 0


def report(rows: list[dict], command: str, args) -> str:
    model = "tiny-llama" if args.quick else "SmolLM2-135M"
    reference = next(r for r in rows if (r["method"], r["logit_chunk"], r.get("variant", "fp32")) == REFERENCE)
    lines = [f"# Causal-LM client memory: full logits vs the chunked output layer, fp32 vs bf16 backbone ({model})",
             "", f"Made by `{command.strip()}`, {time.strftime('%Y-%m-%d')}; one client process per row, "
             f"{args.batch_size} × {args.seq_len} tokens per step, 1 thread. Variants: "
             + "; ".join(f"{k} = {' '.join(v) or 'as configured'}" for k, v in VARIANTS.items() if k in args.variants)
             + ". s/step includes the first step and depends on what else the machine ran."
             + (f" SmartFed's rows with `{args.smartfed_overrides}`." if args.smartfed_overrides else ""), "",
             "| method | train.logit_chunk | variant | peak RSS while training (MB) | above the loaded model (MB) | "
             "÷ same method, full logits, fp32 | ÷ fedavg-lora, full logits, fp32 | s/step | loss |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        own = next(r for r in rows if r["method"] == row["method"] and r["logit_chunk"] == 0
                   and r.get("variant", "fp32") == "fp32")
        lines.append(f"| {row['method']} | {row['logit_chunk'] or 'full'} | {row.get('variant', 'fp32')} | "
                     f"{row['peak_rss_mb']:,.0f} | {row['peak_above_backbone_mb']:,.0f} | "
                     f"{row['peak_rss_mb'] / own['peak_rss_mb']:.2f}× | "
                     f"{row['peak_rss_mb'] / reference['peak_rss_mb']:.2f}× | "
                     f"{row['seconds_per_step']:.2f} | {row['loss']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
