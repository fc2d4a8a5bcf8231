"""What secure aggregation costs: bytes per client per round and time, at N = 4, 8, 16 clients.

    .venv/bin/python bench/secagg.py              # ~5 min on 2 cores; writes docs/bench/secagg/
    .venv/bin/python bench/secagg.py --quick      # protocol table + one simulation pair at N=4

1. **Protocol** (in one process, no Flower runtime: ``strategies.secure_round.local_round``,
   the same messages and checks as a run). For each N and two payloads — FLITE's 1,280
   latents (int4, so 4-bit masks) and a 100,000-value fp32 update (16-bit fixed point) —
   one secure round: the bytes each client sends and receives per stage (Flower's
   ``count_bytes`` of the records: keys, shares, masked payload, unmask), the plain payload
   it replaces, and the CPU seconds per stage (server; clients summed, then per client).
2. **Simulation** (Ray, ``fedapps.simulation.simulate``): FLITE on Fashion-MNIST with the
   tiny CNN (real data, 256 latents), N clients, 2 rounds, secure aggregation off and on:
   the rounds' wall time (mean of rounds 1..R, training and evaluation included), the
   secure stages' bytes per client per round from the run's records, and the accuracy.

Reported in ``OUT/secagg.md`` and ``.json`` with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

STAGES = ("keys", "shares", "deliver", "open", "upload", "unmask", "finish")


def protocol_row(n: int, values: int, payload: str) -> dict:
    """One secure round of N in-process clients over ``values`` values: bytes and seconds."""
    from strategies import codec
    from strategies.base import PayloadFedAvg
    from strategies.secure_round import SecureSettings, local_round

    settings = SecureSettings(bits=4 if payload == "int4" else 16, clip=0.05)
    strategy = PayloadFedAvg(initial_state={"x": np.zeros(values, np.float32)}, config_yaml="", num_clients=n,
                             secure=settings, uplink="delta", uplink_format=payload)
    nodes = list(range(101, 101 + n))
    updates = {v: {"x": np.random.default_rng(v).normal(0, 0.01, values)} for v in nodes}
    timings: dict = {}
    record = local_round(strategy, updates, timings=timings)
    clients = list(record["clients"].values())
    plain = codec.expected_nbytes((values,), codec.FORMATS[payload])
    masked = int(np.mean([c["uplink_payload_bytes"] for c in clients]))
    up = float(np.mean([c["secagg_uplink_bytes"] for c in clients]))
    down = float(np.mean([c["secagg_downlink_bytes"] for c in clients]))
    assert record["secure"]["uploaded"] == n, record
    return {
        "n": n, "values": values, "payload": payload, "bits": settings.bits,
        "modulus_bits": record["secure"]["modulus_bits"],
        "plain_payload_bytes": plain, "masked_payload_bytes": masked, "masked_over_plain": masked / plain,
        "protocol_uplink_bytes": up, "protocol_downlink_bytes": down,
        "server_seconds": sum(timings.get((s, "server"), 0.0) for s in STAGES),
        "client_seconds": sum(timings.get((s, "client"), 0.0) for s in STAGES) / n,
        "stage_seconds": {f"{s}/{side}": round(timings[(s, side)], 4) for s in STAGES for side in ("server", "client")
                          if (s, side) in timings},
    }


def simulation_row(n: int, secure: bool, rounds: int, out: Path) -> dict:
    from fedapps.config import compose
    from fedapps.outputs import read_metrics
    from fedapps.simulation import simulate

    cfg = compose(["model=tiny-cnn", "partition=iid", f"rounds={rounds}", "train.local_steps=15",
                   "train.batch_size=32", "train.lr=0.05", "eval.max_batches=2", "eval.batch_size=64",
                   "task.max_examples=4000", "algorithm.flite.latent_budget=256", f"num_clients={n}",
                   f"secure_aggregation.enabled={str(secure).lower()}", f"output_dir={out}",
                   f"run_name=n{n}-{'secure' if secure else 'plain'}"],
                  task="fmnist", algorithm="flite", preset="none")
    start = time.time()
    summary = simulate(cfg)
    records = read_metrics(summary["run_dir"])[1:]
    clients = [c for r in records for c in r["clients"] if "uplink_payload_bytes" in c]
    return {
        "n": n, "secure": secure, "rounds": rounds,
        "seconds_per_round": float(np.mean([r["seconds"] for r in records])),
        "run_seconds": time.time() - start,
        "payload_bytes": float(np.mean([c["uplink_payload_bytes"] for c in clients])),
        "protocol_uplink_bytes": float(np.mean([c.get("secagg_uplink_bytes", 0) for c in clients])),
        "protocol_downlink_bytes": float(np.mean([c.get("secagg_downlink_bytes", 0) for c in clients])),
        "accuracy": summary["final_metric"], "refused": summary["refused_replies"],
    }


def report(protocol: list[dict], simulation: list[dict], command: str) -> str:
    lines = ["# Secure aggregation: bytes and time", "", f"Made by `{command}` "
             f"({time.strftime('%Y-%m-%d')}, 2 CPU cores).", "",
             "## Protocol, one round (in-process clients, real cryptography)", "",
             "| N | payload | values | bits / modulus | plain payload B | masked payload B | masked / plain "
             "| protocol up B | protocol down B | server s | client s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in protocol:
        lines.append(f"| {r['n']} | {r['payload']} | {r['values']:,} | {r['bits']} / 2^{r['modulus_bits']} | "
                     f"{r['plain_payload_bytes']:,} | {r['masked_payload_bytes']:,} | {r['masked_over_plain']:.2f}× | "
                     f"{r['protocol_uplink_bytes']:,.0f} | {r['protocol_downlink_bytes']:,.0f} | "
                     f"{r['server_seconds']:.3f} | {r['client_seconds']:.3f} |")
    lines += ["", "Protocol bytes are the secure stages' own messages (keys, encrypted shares, unmask "
              "requests and replies, the shares relayed at the deliver stage, the keys with the training message), per client; "
              "they grow with N (one 120-byte encrypted share per other client, twice: sent and relayed). "
              "Client seconds are per client per round.", ""]
    if simulation:
        lines += ["## Simulation (Ray): FLITE, tiny CNN, Fashion-MNIST, 256 latents", "",
                  "| N | secure | s per round | payload B | protocol up B | protocol down B | accuracy |",
                  "|---|---|---|---|---|---|---|"]
        for r in simulation:
            lines.append(f"| {r['n']} | {'on' if r['secure'] else 'off'} | {r['seconds_per_round']:.2f} | "
                         f"{r['payload_bytes']:,.0f} | {r['protocol_uplink_bytes']:,.0f} | "
                         f"{r['protocol_downlink_bytes']:,.0f} | {r['accuracy']:.3f} |")
        lines += ["", "Seconds per round: the round's wall time (training, the secure stages, evaluation), mean "
                  f"over rounds 1..{simulation[0]['rounds']}; one seed — the accuracy column shows the run "
                  "completes and learns, not a comparison between the two modes.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="protocol table + one simulation pair at N=4")
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-simulation", action="store_true")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-secagg")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "secagg")
    args = parser.parse_args(argv)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # messages outside a Flower run
    command = "python bench/secagg.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    protocol = []
    for n in args.clients:
        for payload, values in (("int4", 1280), ("fp32", 100_000)):
            row = protocol_row(n, values, payload)
            protocol.append(row)
            print(f"protocol N={n} {payload}: masked {row['masked_payload_bytes']} B "
                  f"({row['masked_over_plain']:.2f}x plain), protocol up {row['protocol_uplink_bytes']:.0f} B "
                  f"down {row['protocol_downlink_bytes']:.0f} B, server {row['server_seconds']:.3f} s", flush=True)
    simulation = []
    if not args.no_simulation:
        for n in ([args.clients[0]] if args.quick else args.clients):
            for secure in (False, True):
                row = simulation_row(n, secure, args.rounds, args.runs)
                simulation.append(row)
                print(f"simulation N={n} secure={secure}: {row['seconds_per_round']:.2f} s/round, "
                      f"accuracy {row['accuracy']:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(protocol, simulation, command)
    (args.out / "secagg.md").write_text(text + "\n")
    (args.out / "secagg.json").write_text(json.dumps({"command": command, "protocol": protocol,
                                                      "simulation": simulation}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
