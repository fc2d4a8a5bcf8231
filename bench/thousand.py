"""A thousand clients, 100 a round: Flower's simulation at cross-device scale, per method, with its overhead measured.

    .venv/bin/python bench/thousand.py                 # FLITE 30 rounds, then every other arm 3 rounds, ~15 min
    .venv/bin/python bench/thousand.py --quick         # FLITE, 3 rounds: ~1 min
    .venv/bin/python bench/thousand.py --methods fedavg-full topk-ef --rounds 5 --out /tmp/part   # a part

Each arm is one Flower simulation (``fedapps.simulation.simulate``: Ray, Postcard's ServerApp and
ClientApp, as ``postcard``/``flwr run`` run it) of ``--clients`` (1,000) clients on Fashion-MNIST
with the tiny CNN, ``partition=dirichlet`` (α = 0.5, flwr-datasets' partitioner, drawn once for
every client and cached), ``strategy.fraction_train = fraction_evaluate = --per-round / --clients``
(100 of 1,000 a round), 5 local steps, every arm from θ_pre (``base=public``, 1% of every class:
the headroom setting of docs/results.md) with bench/flite.py's default learning rate (not tuned
for this model: the accuracy column says the runs work, it compares nothing). Arms (bench/flite.py's, by name): FLITE int4 (fixed subspace),
per-round FLITE (``full-latent-int4``: the latent channel both ways), fedavg-full fp32 and int4,
top-k with error feedback, PowerSGD; ``flite-dp`` (by ``--methods``): FLITE under central DP,
ε = 8 at δ = 1/N over ``--dp-rounds`` (50), clients sampled by Poisson at q = 0.1 as the
accountant assumes, ε reported per round. ``--llm`` adds fedavg-lora on the tiny random-init Llama
(Shakespeare, IID, preset ``test``) at the same scale, 2 rounds.

Per arm, from the run's ``metrics.jsonl`` (rounds after the first, whose actors start cold):
the round's wall time; the clients' work, ``Σ client-seconds`` of its training and evaluation
messages (the ClientApp's whole work on each: config, session, method, reply) spread over the
simulation's workers; **overhead** = wall − that: what Flower and Ray spend moving 200 messages
and what the server spends sampling, aggregating, checkpointing and recording; and the
method's own share (``Σ seconds``: the training loop / evaluation). Memory: the server process's
peak resident set (it hosts the ServerApp) and the Ray workers' resident sets together, the
largest sampled every 2 s during the run; *per message* = overhead × workers / messages. Targets (issue #63): FLITE ≥ 30 rounds in ≤ 30 minutes; overhead ≤ 10% of the round.
Written to ``OUT/thousand.md`` and ``.json`` with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from flite import METHODS  # noqa: E402  bench/flite.py: the arms by name

ARMS = ("flite-int4", "full-latent-int4", "fedavg-full", "fedavg-full-int4", "topk-ef", "powersgd")


def ray_workers_mb() -> float:
    """Resident memory of this machine's Ray worker processes (the simulated ClientApps), MB."""
    import psutil

    total = 0
    for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if "ray::ClientAppActor" in line or "ClientAppActor" in (proc.info["name"] or ""):
                total += proc.info["memory_info"].rss
        except (psutil.Error, TypeError):
            continue
    return total / 2**20


def rounds_of(run_dir: Path, workers: int) -> list[dict]:
    from fedapps.outputs import read_metrics

    out = []
    for record in read_metrics(run_dir):
        if record["round"] < 1:
            continue
        clients = record["clients"]
        work = sum(c.get("train_client-seconds", 0.0) + c.get("eval_client-seconds", 0.0) for c in clients)
        method = sum(c.get("train_seconds", 0.0) + c.get("eval_seconds", 0.0) for c in clients)
        wall = float(record["seconds"])
        spread = work / workers
        out.append({"round": record["round"], "wall": wall, "client_work": work, "method": method,
                    "spread": spread, "overhead": wall - spread, "overhead_share": (wall - spread) / wall,
                    "messages": sum(("train_client-seconds" in c) + ("eval_client-seconds" in c) for c in clients)})
    return out


def run_arm(name: str, args, out: Path) -> dict:
    from fedapps.config import compose
    from fedapps.simulation import simulate

    fraction = args.per_round / args.clients
    common = [f"num_clients={args.clients}", f"strategy.fraction_train={fraction}",
              f"strategy.fraction_evaluate={fraction}", f"strategy.min_clients={args.per_round}",
              f"output_dir={args.runs}", f"run_name={name}", f"simulation.client_cpus={args.client_cpus}"]
    if name == "llm-fedavg-lora":
        rounds = min(args.rounds, 2)
        cfg = compose([*common, f"rounds={rounds}", "partition=iid"], algorithm="fedavg-lora", task="shakespeare",
                      preset="test")
    else:
        algorithm, overrides, lr = METHODS["flite-int4" if name == "flite-dp" else name]
        if name == "flite-dp":  # central DP, user-level: ε = 8 at δ = 1/N over the run, Poisson sampling at q
            overrides = [*overrides, "privacy.mode=central", "privacy.epsilon=8", f"privacy.delta={1 / args.clients}"]
        if name == "full-latent-int4":  # the tiny CNN's tensors hold fewer than 64 x 8 values: let each take more
            overrides = [*overrides, "channel.rank=1024"]
        rounds = {"flite-int4": args.flite_rounds, "flite-dp": args.dp_rounds}.get(name, args.rounds)
        cfg = compose([*common, *overrides, f"rounds={rounds}", "task.max_examples=null", "train.local_steps=5",
                       f"train.lr={lr}", "partition=dirichlet", "partition.alpha=0.5", "task.public_fraction=0.01"],
                      algorithm=algorithm, task="fmnist", model="tiny-cnn", base="public")
    peak = {"ray": 0.0}
    done = threading.Event()

    def sample() -> None:  # the workers' memory while they serve the run (they are gone after it)
        while not done.wait(2.0):
            peak["ray"] = max(peak["ray"], ray_workers_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    try:
        result = simulate(cfg)
    finally:
        done.set()
        sampler.join()
    total = time.perf_counter() - started
    workers = max(1, int((os.cpu_count() or 1) // args.client_cpus))
    rows = rounds_of(Path(result["run_dir"]), workers)
    summary = json.loads((Path(result["run_dir"]) / "summary.json").read_text())
    from fedapps.outputs import read_metrics

    records = read_metrics(result["run_dir"])
    privacy = [(r["round"], r["privacy"]) for r in records if r.get("privacy")]
    down = sorted(c[f"{p}_downlink_payload_bytes"] for r in records if r["round"] >= 1 for c in r["clients"]
                  for p in ("train", "eval") if f"{p}_downlink_payload_bytes" in c)

    def mean(key):
        return sum(r[key] for r in rows) / len(rows) if rows else float("nan")

    return {"arm": name, "rounds": rounds, "run_seconds": total, "workers": workers, "per_round": rows,
            "wall": mean("wall"), "spread": mean("spread"), "method": mean("method"), "overhead": mean("overhead"),
            "overhead_share": mean("overhead_share"), "messages": mean("messages"),
            "server_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "ray_workers_mb": peak["ray"], "final_metric": summary.get("final_metric"),
            "initial_metric": summary.get("initial_metric"),
            "privacy": [{"round": k, **v} for k, v in privacy],
            "downlink_bytes": {q: (down[min(len(down) - 1, int(q / 100 * len(down)))] if down else None)
                               for q in (0, 50, 90, 99, 100)},
            "uplink_bytes": summary.get("uplink_bytes_per_client_per_round"), "run_dir": str(result["run_dir"])}


def report(rows: list[dict], command: str, args, failed: list[str] = ()) -> str:
    lines = [f"# {args.clients} clients, {args.per_round} a round", "",
             f"`{command}` ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU cores). Fashion-MNIST, tiny CNN, "
             "Dirichlet α = 0.5, 5 local steps; means over rounds 2.. (round 1 starts the actors). *clients' work*: "
             "Σ client-seconds of the round's training and evaluation messages over the workers; *method*: the "
             "training loops and evaluations alone (Σ seconds over the workers); *overhead* = wall − clients' work.",
             "", "| arm | rounds | run s | round wall s | clients' work s | of it the method s | overhead s | "
                 "overhead % | overhead per message ms | server peak MB | Ray workers MB | metric (accuracy; the LLM: perplexity), round 0 → last |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        metric = "–" if r["final_metric"] is None else f"{r.get('initial_metric') or float('nan'):.3f} → {r['final_metric']:.3f}"
        if r["messages"]:
            work = (f"{r['spread']:.2f} | {r['method'] / r['workers']:.2f} | {r['overhead']:.2f} | "
                    f"{100 * r['overhead_share']:.0f}% | {1000 * r['overhead'] * r['workers'] / r['messages']:.1f}")
        else:  # a private run keeps nothing per client, client-seconds included
            work = "– | – | – | – | –"
        lines.append(f"| {r['arm']} | {r['rounds']} | {r['run_seconds']:.0f} | {r['wall']:.2f} | {work} | "
                     f"{r['server_peak_mb']:.0f} | {r['ray_workers_mb']:.0f} | {metric} |")
    lines += [f"- **failed**: {f}" for f in failed]
    downlinks = []
    for r in rows:
        d = {int(k): v for k, v in (r.get("downlink_bytes") or {}).items()}
        if d.get(50) is not None:
            downlinks.append(f"- {r['arm']}: " + " / ".join(f"{d[q]:,}" for q in (0, 50, 90, 99, 100)))
    if downlinks:
        lines += ["", "Downlink payload bytes per message (rounds 1 and on, training and evaluation), min / median / "
                      "90th / 99th percentile / max:", *downlinks]
    for r in rows:
        if r.get("privacy"):
            marks = [p for p in r["privacy"] if p["round"] in (1, 10, 25, r["rounds"])]
            first = r["privacy"][-1]
            lines += ["", f"{r['arm']}: central DP, Poisson sampling at q = {args.per_round / args.clients:g} of "
                          f"{args.clients}, δ = 1/N = {1 / args.clients:g}, noise multiplier "
                          f"{first.get('noise_multiplier', float('nan')):.3g}; ε after round "
                          + ", ".join(f"{p['round']}: {p['epsilon']:.3g}" for p in marks) + "."]
    flite = next((r for r in rows if r["arm"] == "flite-int4"), None)
    if flite is not None:
        rounds_met = flite["rounds"] >= 30 and flite["run_seconds"] <= 1800
        lines += ["", f"Targets (issue #63): FLITE {flite['rounds']} rounds in {flite['run_seconds'] / 60:.1f} min "
                      f"(≥ 30 in ≤ 30: **{'met' if rounds_met else 'not shown' if flite['rounds'] < 30 else 'missed'}**); "
                      f"overhead {100 * flite['overhead_share']:.0f}% of the round (≤ 10%: "
                      f"**{'met' if flite['overhead_share'] <= 0.10 else 'missed'}**)."]
    return "\n".join(lines)


def render(out: Path) -> str:
    """OUT/thousand.md again from OUT/thousand.json (what each run measured is kept there)."""
    data = json.loads((out / "thousand.json").read_text())
    settings = argparse.Namespace(**data.get("settings", {"clients": 1000, "per_round": 100}))
    text = report(data["rows"], data["command"], settings, data.get("failed", []))
    (out / "thousand.md").write_text(text + "\n")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="FLITE only, 3 rounds")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every arm but FLITE")
    parser.add_argument("--flite-rounds", type=int, default=30)
    parser.add_argument("--dp-rounds", type=int, default=50, help="rounds of the flite-dp arm")
    parser.add_argument("--methods", nargs="+", default=list(ARMS), choices=[*ARMS, "llm-fedavg-lora", "flite-dp"])
    parser.add_argument("--llm", action="store_true", help="also fedavg-lora on the tiny Llama, 2 rounds")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="simulation.client_cpus (workers = cores / it)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "thousand")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-thousand", help="the run folders")
    parser.add_argument("--render", action="store_true", help="only write OUT/thousand.md again from OUT/thousand.json")
    args = parser.parse_args(argv)
    if args.render:
        print(render(args.out))
        return 0
    if args.quick:
        args.methods, args.flite_rounds = ["flite-int4"], 3
    methods = list(args.methods) + (["llm-fedavg-lora"] if args.llm else [])
    command = "python bench/thousand.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    for name in methods:
        print(f"thousand: {name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_arm(name, args, args.out))
        except Exception as err:  # noqa: BLE001 - one arm's failure is a row of the report, not the end of it
            failed.append(f"{name}: {type(err).__name__}: {err}")
            print(f"thousand: {name} failed: {err}", file=sys.stderr, flush=True)
            continue
        r = rows[-1]
        print(f"thousand: {name}: {r['rounds']} rounds in {r['run_seconds']:.0f} s, {r['wall']:.2f} s a round",
              file=sys.stderr, flush=True)
        text = report(rows, command, args, failed)  # written after every arm: a long run keeps what it did
        (args.out / "thousand.md").write_text(text + "\n")
        (args.out / "thousand.json").write_text(json.dumps(
            {"command": command, "settings": {"clients": args.clients, "per_round": args.per_round}, "rows": rows,
             "failed": failed}, indent=1) + "\n")
    text = report(rows, command, args, failed)
    (args.out / "thousand.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
