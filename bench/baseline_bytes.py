"""Uplink bytes per client per round of each baseline on the embedded SmolLM2.

Builds each algorithm's client model exactly as a run does, encodes its federated state
with the wire codec, and prints the payload bytes (what every client sends each round)
and Flower's count of the whole ArrayRecord (tensor names included).

    .venv/bin/python bench/baseline_bytes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clients.adapters import federated_state  # noqa: E402
from fedapps.baselines import prepare  # noqa: E402
from fedapps.config import compose  # noqa: E402
from strategies import codec  # noqa: E402


def main() -> None:
    rows = []
    for algorithm in ("fedavg-lora", "fedprox", "ffa-lora", "fedavg-full"):
        cfg = compose(algorithm=algorithm, model="smollm2")
        model, _, extra = prepare(cfg)
        state = federated_state(model, extra["names"])
        record = codec.encode({k: v.numpy() for k, v in state.items()}, str(cfg.algorithm.payload))
        values = sum(v.numel() for v in state.values())
        rows.append((algorithm, len(state), values, codec.payload_bytes(record), record.count_bytes()))
        del model
    base = rows[0][3]
    print("| algorithm | tensors | values | uplink payload bytes | ArrayRecord bytes | vs fedavg-lora |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, tensors, values, payload, total in rows:
        print(f"| {name} | {tensors} | {values:,} | {payload:,} | {total:,} | {payload / base:.3f} |")


if __name__ == "__main__":
    main()
