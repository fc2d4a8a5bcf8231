"""Uplink bytes per client per round of each baseline and of FedNL's modes on the embedded SmolLM2.

Builds each algorithm's client model exactly as a run does, encodes its federated state
with the wire codec, and prints the payload bytes (what every client sends each round)
and Flower's count of the whole ArrayRecord (tensor names included).

    .venv/bin/python bench/baseline_bytes.py [--out docs/bench]   # also writes OUT/baseline_bytes.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clients.adapters import federated_state  # noqa: E402
from fedapps.baselines import prepare  # noqa: E402
from fedapps.config import compose  # noqa: E402
from strategies import codec  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "bench",
                        help="folder for baseline_bytes.md (default docs/bench)")
    args = parser.parse_args(argv)
    rows = []
    from fedapps import fednl

    for algorithm, overrides in (("fedavg-lora", []), ("fedprox", []), ("ffa-lora", []), ("fedavg-full", []),
                                 ("fednl", []), ("fednl", ["algorithm.mode=gate"]),
                                 ("fednl", ["algorithm.mode=gate", "algorithm.memory.beta=constant"])):
        cfg = compose(overrides, algorithm=algorithm, model="smollm2")
        model, _, extra = (fednl.prepare if algorithm == "fednl" else prepare)(cfg)
        if algorithm == "fednl":
            algorithm = f"fednl ({' '.join(o.split('.')[-1] for o in overrides) or 'mode=meta-rules'})"
        state = federated_state(model, extra["names"])
        record = codec.encode({k: v.numpy() for k, v in state.items()}, str(cfg.algorithm.payload))
        values = sum(v.numel() for v in state.values())
        rows.append((algorithm, len(state), values, codec.payload_bytes(record), record.count_bytes()))
        del model
    base = rows[0][3]
    lines = ["# Uplink bytes per client per round of the baselines and of FedNL's modes (SmolLM2-135M)", "",
             "Made by `bench/baseline_bytes.py`: each algorithm's client model built as a run builds it, "
             "its federated state encoded with the wire codec.", "",
             "| algorithm | tensors | values | uplink payload bytes | ArrayRecord bytes | vs fedavg-lora | "
             "fedavg-lora ÷ this |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, tensors, values, payload, total in rows:
        lines.append(f"| {name} | {tensors} | {values:,} | {payload:,} | {total:,} | {payload / base:.4f} | "
                     f"{base / payload:,.1f}× |")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "baseline_bytes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
