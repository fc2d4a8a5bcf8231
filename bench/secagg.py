"""What secure aggregation costs: bytes per client per round and time, at N = 4, 8, 16 clients.

    .venv/bin/python bench/secagg.py              # ~5 min on 2 cores; writes docs/bench/secagg/
    .venv/bin/python bench/secagg.py --quick      # protocol table + one simulation pair at N=4
    .venv/bin/python bench/secagg.py --scale --scale-max 200   # n = 10..200, 10% dropouts: OUT/scale.md
    .venv/bin/python bench/secagg.py --bound      # ~2 s: one hostile uploader's reach, OUT/bound.md

1. **Protocol** (in one process, no Flower runtime: ``strategies.secure_local.local_round``,
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
    from strategies.secure_local import local_round
    from strategies.secure_round import SecureSettings

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


# ---------------------------------------------------------------------- --scale: n = 10 .. 200, 10% dropouts
# Which stage each byte belongs to: the SecureStages step that counts it, and whether it is a reply (up) or a
# message (down). A step takes the previous stage's replies and sends the next stage's messages.
_UP_STAGE = {"keys": "keys", "shares": "shares", "deliver": "deliver", "open": "open", "upload": "upload",
             "finish": "unmask"}
_DOWN_STAGE = {"begin": "keys", "keys": "shares", "shares": "deliver", "deliver": "upload", "open": "upload",
               "upload": "unmask"}
SCALE_STAGES = ("keys", "shares", "deliver", "open", "upload", "unmask", "finish")


def scale_row(n: int, drop: str, fraction: float = 0.1, values: int = 1280, payload: str = "int4") -> dict:
    """One secure round of ``n`` in-process clients over FLITE's payload (``values`` int4 latents: 4-bit
    masks, threshold a majority) with ``fraction`` of them dropping out: ``drop='upload'`` (mid-round: after
    the shares stage they never upload) or ``'unmask'`` (after uploading, they never answer the unmask
    stage). Completion, exactness against the plain mean of the uploaders' quantised updates, server seconds
    per stage, client seconds per client, bytes per client per stage (up and down)."""
    from strategies import codec
    from strategies.base import PayloadFedAvg
    from strategies.secure_local import local_round
    from strategies.secure_round import SecureSettings

    settings = SecureSettings(bits=4 if payload == "int4" else 16, clip=0.05)
    strategy = PayloadFedAvg(initial_state={"x": np.zeros(values, np.float32)}, config_yaml="", num_clients=n,
                             secure=settings, uplink="delta", uplink_format=payload)
    nodes = list(range(101, 101 + n))
    updates = {v: {"x": np.random.default_rng(v).normal(0, 0.01, values)} for v in nodes}
    dropping = nodes[::max(1, round(1 / fraction))][:max(1, round(fraction * n))] if fraction > 0 else []
    uploaders = [v for v in nodes if drop != "upload" or v not in dropping]

    # bytes per (stage, direction, node): the ledger's add_bytes, labelled by the step that calls it
    stages = strategy.secure_stages
    step = {"name": None}
    per_stage: dict = {}
    ledger_add = strategy.ledger.add_bytes

    def add_bytes(node_id, key, nbytes):
        table = _UP_STAGE if key == "secagg_uplink_bytes" else _DOWN_STAGE
        stage = table.get(step["name"], step["name"])
        key2 = (stage, "up" if key == "secagg_uplink_bytes" else "down")
        per_stage.setdefault(key2, {}).setdefault(int(node_id), 0)
        per_stage[key2][int(node_id)] += int(nbytes)
        ledger_add(node_id, key, nbytes)

    strategy.ledger.add_bytes = add_bytes
    for name in ("begin", "keys", "shares", "deliver", "open", "upload", "finish"):
        def wrapped(*args, _fn=getattr(stages, name), _name=name):
            step["name"] = _name
            try:
                return _fn(*args)
            finally:
                step["name"] = None
        setattr(stages, name, wrapped)

    timings: dict = {}
    start = time.perf_counter()
    record = local_round(strategy, updates, timings=timings,
                         skip_upload=dropping if drop == "upload" else (),
                         skip_unmask=dropping if drop == "unmask" else ())
    wall = time.perf_counter() - start
    secure = record.get("secure")
    refused_round = [r for r in record.get("refused", []) if r.get("kind") == "round"]
    completed = secure is not None and not refused_round
    # exactness: the new global state (initial zeros) against the plain mean of the uploaders' quantised updates
    fixed = settings.fixed_point(n)
    decoded = []
    for v in uploaders:
        levels, _ = fixed.encode(np.asarray(updates[v]["x"], np.float64), np.random.default_rng(v))
        decoded.append(levels * fixed.step - fixed.clip)
    plain = np.mean(decoded, axis=0)
    got = np.asarray(strategy.global_state["x"], np.float64)
    error = float(np.max(np.abs(got - plain))) if completed else float("nan")
    clients = {int(k): c for k, c in record["clients"].items()}
    plain_bytes = codec.expected_nbytes((values,), codec.FORMATS[payload])
    masked = float(np.mean([clients[v]["uplink_payload_bytes"] for v in uploaders if "uplink_payload_bytes"
                            in clients.get(v, {})]))
    stage_bytes = {}
    for stage in SCALE_STAGES:
        for side in ("up", "down"):
            table = per_stage.get((stage, side), {})
            if table:
                stage_bytes[f"{stage}/{side}"] = float(np.mean([table.get(v, 0) for v in nodes]))
    stage_bytes["upload/up (masked payload)"] = masked
    # a client that stays to the end: every stage's bytes, up and down, and its masked payload
    full = [v for v in nodes if v not in dropping]
    total_full = float(np.mean([clients[v].get("secagg_uplink_bytes", 0) + clients[v].get("secagg_downlink_bytes", 0)
                                + clients[v].get("uplink_payload_bytes", 0) for v in full]))
    server = {s: timings.get((s, "server"), 0.0) for s in SCALE_STAGES}
    client = {s: timings.get((s, "client"), 0.0) / n for s in SCALE_STAGES}
    return {
        "n": n, "drop": drop, "dropouts": len(dropping), "uploaded": (secure or {}).get("uploaded"),
        "threshold": (secure or {}).get("threshold"), "modulus_bits": (secure or {}).get("modulus_bits"),
        "completed": completed, "refused_round": [r.get("reason") for r in refused_round],
        "max_abs_error": error, "exact": bool(completed and error <= 1e-6),
        "server_seconds": sum(server.values()), "server_stage_seconds": {k: round(v, 4) for k, v in server.items()},
        "client_seconds": sum(client.values()), "client_stage_seconds": {k: round(v, 5) for k, v in client.items()},
        "wall_seconds": wall, "plain_payload_bytes": plain_bytes, "masked_payload_bytes": masked,
        "stage_bytes": {k: round(v, 1) for k, v in stage_bytes.items()},
        "client_total_bytes": total_full, "total_over_plain": total_full / plain_bytes,
    }


def scale_report(rows: list[dict], command: str) -> str:
    lines = ["# Secure aggregation at scale: n clients a round, 10% dropping out", "",
             f"Made by `{command}` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, one process: "
             "`strategies.secure_local.local_round`, real cryptography, no Flower runtime).", "",
             "FLITE's payload: 1,280 latents, int4 (4-bit masks, modulus 2^(4+⌈log2 n⌉)), plain payload "
             f"{rows[0]['plain_payload_bytes']} B; threshold null = a majority. `upload`: 10% of the clients vanish "
             "mid-round (after the shares stage, never upload: the server reconstructs their mask keys and regenerates "
             "their pair masks); `unmask`: 10% vanish after uploading (their self-mask seeds are reconstructed from "
             "the others' shares).", "",
             "| n | drop | dropouts | t | completed | exact (max err) | server s | keys | shares | deliver | open "
             "| unmask | finish | client s each | bytes / client | ÷ 648 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["server_stage_seconds"]
        lines.append(f"| {r['n']} | {r['drop']} | {r['dropouts']} | {r['threshold']} | {'yes' if r['completed'] else 'NO'} "
                     f"| {'yes' if r['exact'] else 'NO'} ({r['max_abs_error']:.1e}) | {r['server_seconds']:.2f} | "
                     + " | ".join(f"{s[k]:.3f}" for k in ("keys", "shares", "deliver", "open", "unmask", "finish"))
                     + f" | {r['client_seconds']:.3f} | {r['client_total_bytes']:,.0f} | "
                     f"{r['total_over_plain']:.0f}× |")
    lines += ["", "Server seconds per stage are `local_round`'s: the server step that *sends* that stage's messages "
              "(`keys`: send the keys requests; `shares`: check the keys, send everyone's keys; `deliver`: check the "
              "n·(n−1) encrypted shares and build each client's mailbox; `open`: check the complaints (none here), "
              "attach the final participants' keys to the training messages; `unmask`: check the masked uploads, send "
              "the unmask requests; `finish`: check every revealed share against its digest, reconstruct each "
              "uploader's self-mask seed and each dropout's mask key (t-of-n Shamir), regenerate the masks, decode). "
              "Client seconds: all stages, per client. Bytes per client: a client that "
"stays to the end, every secure message up and down plus its masked payload (the plain model "
              "downlink not counted).", "",
              "## Bytes per client per stage (mean over all n clients; up / down)", "",
              "| n | drop | " + " | ".join(f"{s}" for s in ("keys", "shares", "deliver", "upload", "unmask"))
              + " | masked payload |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["stage_bytes"]
        cells = [f"{b.get(s + '/up', 0):,.0f} / {b.get(s + '/down', 0):,.0f}"
                 for s in ("keys", "shares", "deliver", "upload", "unmask")]
        lines.append(f"| {r['n']} | {r['drop']} | " + " | ".join(cells) + f" | {r['masked_payload_bytes']:,.0f} |")
    lines += ["", "## Growth with n (ratio of the n=100 row to the n=50 row; ×2 = linear, ×4 = quadratic)", ""]
    for drop in ("upload", "unmask"):
        by_n = {r["n"]: r for r in rows if r["drop"] == drop}
        if 50 in by_n and 100 in by_n:
            a, b = by_n[50], by_n[100]
            cells = []
            for k in ("shares", "deliver", "open", "unmask", "finish"):
                x, y = a["server_stage_seconds"][k], b["server_stage_seconds"][k]
                cells.append(f"server {k} ×{y / x:.1f}" if x > 0 else f"server {k} –")
            cells.append(f"server total ×{b['server_seconds'] / a['server_seconds']:.1f}")
            cells.append(f"client s each ×{b['client_seconds'] / a['client_seconds']:.1f}")
            for k in ("shares/up", "deliver/down", "unmask/up"):
                x, y = a["stage_bytes"].get(k, 0), b["stage_bytes"].get(k, 0)
                if x:
                    cells.append(f"bytes {k} per client ×{y / x:.1f}")
            cells.append(f"bytes per client ×{b['client_total_bytes'] / a['client_total_bytes']:.1f}")
            lines.append(f"- `{drop}`: " + ", ".join(cells) + ".")
    slow = [r for r in rows if r["n"] == 100 and r["server_seconds"] > 30]
    lines += ["", "## Where the super-linear cost sits", "",
              "- **Bytes, O(n) per client, O(n²) in all.** Each client deals one 120-byte encrypted share to every "
              "other client (`shares/up`), and the server relays them (`deliver/down`, with the n digests): n² "
              "encryptions and n² relayed shares a round, so a client's bytes grow linearly with n and the "
              "server's traffic quadratically. The unmask reply is O(n) per client too (one share of every other "
              "participant). The masked payload itself grows only by the modulus (4 + ⌈log2 n⌉ bits: uint8 up "
              "to 16 clients, uint16 beyond).",
              "- **Server time: `finish`, O(n·t²) ≈ O(n³) with t = n/2.** The other steps stay in milliseconds. "
              "`finish` checks n·(n−1) revealed shares against their digests (O(n²) hashes), then reconstructs "
              "one t-of-n Shamir secret per uploader (self-mask seed, 16 B) and per dropout (mask key, 32 B: two "
              "16-byte blocks), each with pycryptodome's pure-Python Lagrange interpolation over GF(2^128) — "
              "O(t²) field multiplications per block — and twice (`_consistent` recombines from the last t "
              "shares to catch a dealer whose shares disagree). Regenerating the pair masks of each dropout × "
              "uploader (O(d·n·payload)) and the self-masks (O(n·payload)) is cheap at 1,280 values.",
              "- **Client time, O(n) per client**: n X25519 agreements and n share encryptions at the shares "
              "stage, n decryptions and digest checks at deliver, n reveals at unmask.", ""]
    if slow:
        lines += [f"The server exceeds 30 s at n = 100 ({slow[0]['server_seconds']:.1f} s)."]
    return "\n".join(lines)


def scale_main(sizes: list[int], out: Path, command: str, fraction: float = 0.1) -> list[dict]:
    rows = []
    for n in sizes:
        for drop in ("upload", "unmask"):
            row = scale_row(n, drop, fraction)
            rows.append(row)
            print(f"scale n={n} drop={drop}: completed={row['completed']} exact={row['exact']} "
                  f"server {row['server_seconds']:.2f} s {row['server_stage_seconds']}, client "
                  f"{row['client_seconds']:.3f} s each, {row['client_total_bytes']:,.0f} B/client "
                  f"({row['total_over_plain']:.0f}x plain), wall {row['wall_seconds']:.1f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    text = scale_report(rows, command)
    (out / "scale.md").write_text(text + "\n")
    (out / "scale.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    print(text)
    return rows


def bound_rows(sizes=(4, 5, 10, 16, 17), bits=(4, 16), dim=10_000, seed=0) -> list[dict]:
    """One hostile uploader of ``m`` under secure aggregation, knowing the honest sum (the worst case),
    through the server's own fixed point (``FixedPoint``: encode, the sum mod 2^k, ``clamp_sum``, decode).
    Honest updates ``0.25·clip·(c + 0.5·ε_i)``; the hostile one: *in range* (−clip × the sign of the honest
    mean, encoded as a client would), *wrap* (a residue that makes each coordinate's sum 0 or 2^k − 1, the
    farthest from the honest mean), *range ends* (sums 0 or m·levels: what no check on the sum can tell
    from honest uploads). Displacement: ‖mean with it − mean of the honest uploads‖ / ‖mean of the honest
    uploads‖, without the clamp (before #62) and with it."""
    from strategies.secagg import FixedPoint

    rows = []
    for b in bits:
        for m in sizes:
            fixed = FixedPoint(bits=b, clip=1.0, num_clients=m)
            rng = np.random.default_rng([seed, m, b])
            common = rng.normal(size=dim)
            honest = [fixed.encode(0.25 * (common + 0.5 * rng.normal(size=dim)), rng)[0] for _ in range(m - 1)]
            honest_sum = np.sum(honest, axis=0).astype(np.uint64)
            reference = fixed.decode_sum(honest_sum, m - 1) / (m - 1)
            up = reference < 0  # push each value away from the honest mean
            modulus, top = np.uint64(fixed.modulus), np.uint64(m * fixed.levels)
            targets = {
                "in range": None,
                "wrap": np.where(up, modulus - np.uint64(1), np.uint64(0)),
                "range ends": np.where(up, top, np.uint64(0)),
            }
            for attack, target in targets.items():
                if target is None:
                    mine = fixed.encode(np.where(up, 1.0, -1.0), rng)[0]
                else:
                    mine = (target + modulus - honest_sum % modulus) % modulus
                total = (honest_sum + mine) % modulus
                row = {"bits": b, "uploaders": m, "modulus_bits": fixed.modulus_bits, "attack": attack}
                for name, summed in (("unclamped", total), ("clamped", fixed.clamp_sum(total, m)[0])):
                    mean = fixed.decode_sum(summed, m) / m
                    row[name] = float(np.linalg.norm(mean - reference) / np.linalg.norm(reference))
                rows.append(row)
    return rows


def bound_report(rows: list[dict], command: str) -> str:
    lines = ["# One hostile uploader under secure aggregation: how far it moves the mean", "",
             f"`{command}` (numpy only, ~2 s). In honest steps: ‖mean with it − mean of the honest uploads‖ / "
             "‖mean of the honest uploads‖; the hostile client knows the honest sum (the worst case). "
             "*unclamped*: the sum decoded as it unmasks (before issue #62); *clamped*: "
             "`FixedPoint.clamp_sum` first, as the server now does.", "",
             "| bits | uploaders m | modulus bits | attack | unclamped | clamped |", "|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['bits']} | {r['uploaders']} | {r['modulus_bits']} | {r['attack']} | {r['unclamped']:.2f} "
                     f"| {r['clamped']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="protocol table + one simulation pair at N=4")
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-simulation", action="store_true")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-secagg")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "secagg")
    parser.add_argument("--scale", action="store_true", help="only the scale table: n = 10, 50, 100 (and up to "
                        "--scale-max) clients, 10%% dropping mid-round / after uploading; writes OUT/scale.md, .json")
    parser.add_argument("--scale-max", type=int, default=100)
    parser.add_argument("--bound", action="store_true", help="only one hostile uploader's reach (in range, "
                        "wrapping around the modulus, at the range's ends), before and after the clamp: OUT/bound.md")
    args = parser.parse_args(argv)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # messages outside a Flower run
    command = "python bench/secagg.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.bound:
        rows = bound_rows()
        text = bound_report(rows, command)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bound.md").write_text(text + "\n")
        (args.out / "bound.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        print(text)
        return 0
    if args.scale:
        scale_main([n for n in (10, 50, 100, 200) if n <= args.scale_max], args.out, command)
        return 0
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
