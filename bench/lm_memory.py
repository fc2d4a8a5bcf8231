"""Client peak memory and speed of causal-LM local training, full logits vs the chunked output layer.

    .venv/bin/python bench/lm_memory.py                       # fedavg-lora, flite, fednl on SmolLM2, ~6 min
    .venv/bin/python bench/lm_memory.py --quick               # tiny-llama, seconds
    .venv/bin/python bench/lm_memory.py --methods fedavg-lora --chunks 0 64 256

Each (method, ``train.logit_chunk``) runs in a fresh process (``bench/memory.py``, the probe
bench/smartfed.py uses too): the method's ``prepare`` builds the client's model (SmolLM2-135M
with the method's adapters), then ``--steps`` local AdamW steps on the first Shakespeare
client's windows (``--batch-size`` × ``--seq-len`` tokens). Reported per row: the process's
peak resident memory while training (Linux ``VmHWM``, reset once the model is built), the
part of it above the loaded model, seconds per step (the first step included), and the
ratio of peak memory to the same method with the full logits (chunk 0).
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

METHODS = ("fedavg-lora", "flite", "fednl")

def measure(method: str, chunk: int, args) -> dict:
    from fedapps.config import compose

    overrides = [f"train.logit_chunk={chunk}", f"train.batch_size={args.batch_size}", f"train.seq_len={args.seq_len}",
                 "train.threads=1", "train.progress_seconds=0"]
    if args.quick:
        overrides.append("model=tiny-llama")
    cfg = compose(overrides, algorithm=method, task="shakespeare", preset="none")
    return measure_memory(cfg, args.workdir, args.steps, name=f"{method}-chunk{chunk}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--chunks", nargs="+", type=int, default=[0, 256], help="train.logit_chunk values (0 = full logits)")
    p.add_argument("--steps", type=int, default=3, help="local steps measured (peak memory and s/step)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="tiny-llama instead of SmolLM2 (seconds)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "lm_memory")
    args = p.parse_args(argv)
    args.workdir = Path(tempfile.mkdtemp(prefix="lm-memory-"))
    if 0 not in args.chunks:
        args.chunks = [0, *args.chunks]  # the reference of every ratio
    command = "bench/lm_memory.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    rows = []
    for method in args.methods:
        for chunk in args.chunks:
            print(f"[bench {time.strftime('%H:%M:%S')}] {method}, train.logit_chunk={chunk}", flush=True)
            rows.append({"method": method, "logit_chunk": chunk, **measure(method, chunk, args)})
            print(f"    peak {rows[-1]['peak_rss_mb']:,.0f} MB, {rows[-1]['seconds_per_step']:.2f} s/step", flush=True)
    model = "tiny-llama" if args.quick else "SmolLM2-135M"
    lines = [f"# Causal-LM client memory: full logits vs the chunked output layer ({model})", "",
             f"Made by `{command.strip()}`, {time.strftime('%Y-%m-%d')}; one client process per row, "
             f"{args.batch_size} × {args.seq_len} tokens per step, 1 thread.", "",
             "| method | train.logit_chunk | peak RSS while training (MB) | above the loaded model (MB) | "
             "÷ full logits | s/step | loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ref = next(r for r in rows if r["method"] == row["method"] and r["logit_chunk"] == 0)
        lines.append(f"| {row['method']} | {row['logit_chunk'] or 'full'} | {row['peak_rss_mb']:,.0f} | "
                     f"{row['peak_above_backbone_mb']:,.0f} | {row['peak_rss_mb'] / ref['peak_rss_mb']:.2f}× | "
                     f"{row['seconds_per_step']:.2f} | {row['loss']:.4f} |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_memory.md").write_text(text)
    (args.out / "lm_memory.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
