"""Flower's own share of a round: wall time minus the slowest client's work, simulation vs deployment (cold, warm).

    .venv/bin/python bench/overhead.py            # tiny model and SmolLM2, ~15 min on 2 cores
    .venv/bin/python bench/overhead.py --quick    # the tiny model only: a few minutes
    .venv/bin/python bench/overhead.py --models smollm2 --modes deployment --out /tmp/part   # in parts ...
    .venv/bin/python bench/overhead.py --modes simulation --merge /tmp/part/overhead.json    # ... one table

Per configuration, ``--clients`` (5) clients run ``--rounds`` (2) rounds of fedavg-lora on
Shakespeare (preset ``test`` for the tiny Llama, ``demo`` for SmolLM2), every client of a
round at once (simulation: ``simulation.client_cpus`` = cores / clients, so Ray starts them
together; deployment: one SuperNode each):

* **simulation** — ``fedapps.simulation.simulate`` (Flower's simulation runtime, Ray);
* **deployment** — ``postcard.deploy.run_local(warm=False)``: a SuperLink and a SuperNode per
  client on 127.0.0.1 (TLS, node authentication), where Flower 1.42 starts a fresh
  ``flwr-clientapp`` process for every message (the cold path, stock Flower);
* **warm** — the same cluster with a warm node worker beside each SuperNode
  (``postcard.worker``, docs/deploy.md §9): one process per node keeps the model for the run.

When both deployments ran, their model outputs (every loss and metric of ``metrics.jsonl``
but timings and message sizes) are compared: the report says whether they are bit-identical.

From each round's record (``metrics.jsonl``): its wall time (the strategy's first message to
its evaluation's aggregate), and per client ``client-seconds`` (the ClientApp's whole work on
a message: config, session — in a fresh process that is building the model —, the method,
the reply) and ``seconds`` (the method's own training loop / evaluation). Reported per
round after the first (warm Ray actors):

    overhead = wall − (slowest train client-seconds + slowest evaluate client-seconds)

— what Flower (and Ray) spend moving messages, starting processes, and what the server
spends aggregating — and ``setup = client-seconds − seconds`` (Postcard's per-message work
outside the method: in deployment mode mostly the model built again in each new process).
Written to ``OUT/overhead.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

MODELS = {"tiny-llama": "test", "smollm2": "demo"}


def rounds_of(run_dir: Path) -> list[dict]:
    """Per trained round: wall, the slowest client's work per phase, and its setup share."""
    from fedapps.outputs import read_metrics

    out = []
    for record in read_metrics(run_dir):
        if record["round"] < 1:
            continue
        clients = record["clients"]

        def slowest(key: str) -> float:
            values = [c[key] for c in clients if key in c]
            return float(max(values)) if values else 0.0

        work = slowest("train_client-seconds") + slowest("eval_client-seconds")
        method = slowest("train_seconds") + slowest("eval_seconds")
        out.append({"round": record["round"], "wall": float(record["seconds"]), "client_work": work,
                    "method": method, "setup": work - method, "overhead": float(record["seconds"]) - work,
                    "clients": len(clients)})
    return out


def simulation(model: str, clients: int, rounds: int, out: Path) -> Path:
    from fedapps.config import compose
    from fedapps.simulation import simulate

    cpus = max(0.1, round((os.cpu_count() or 1) / clients, 2))
    cfg = compose([f"model={model}", f"num_clients={clients}", f"rounds={rounds}", "partition=iid",
                   f"simulation.client_cpus={cpus}", f"output_dir={out}", f"run_name=sim-{model}"],
                  algorithm="fedavg-lora", task="shakespeare", preset=MODELS[model])
    return Path(simulate(cfg)["run_dir"])


def deployment(model: str, clients: int, rounds: int, out: Path, warm: bool = False) -> Path:
    from postcard.deploy import run_local

    name = f"{'warm' if warm else 'deploy'}-{model}"
    overrides = " ".join([f"model={model}", f"num_clients={clients}", f"rounds={rounds}", "partition=iid",
                          f"run_name={name}"])
    before = set(out.glob(f"{name}*"))
    cluster = out / f"cluster-{name}"  # kept: the SuperLink's and SuperNodes' logs (`flwr run` exits 0 on failure)
    shutil.rmtree(cluster, ignore_errors=True)
    code = run_local(clients, f"algorithm='fedavg-lora' task='shakespeare' preset='{MODELS[model]}' "
                              f"overrides='{overrides}'", out, folder=cluster, warm=warm)
    if code:
        raise SystemExit(f"overhead: the {'warm ' if warm else ''}deployment run of {model} failed (exit {code})")
    new = sorted(set(out.glob(f"{name}*")) - before)  # a run folder's name gets -2, -3, ... when taken
    if len(new) != 1:
        raise SystemExit(f"overhead: expected one new run folder {name}* in {out}, found {new}")
    return new[0]


def warm(model: str, clients: int, rounds: int, out: Path) -> Path:
    return deployment(model, clients, rounds, out, warm=True)


MODES = {"simulation": simulation, "deployment": deployment, "warm": warm}


def model_outputs(run_dir: Path) -> list:
    """Every round's client metrics but timings, node ids and message sizes (a message carries the
    timings, and the first the run's config with its run_name)."""
    from fedapps.outputs import read_metrics

    def kept(key: str) -> bool:
        return "seconds" not in key and key != "node_id" and not key.endswith(("message_bytes", "wire_bytes"))

    return [sorted((sorted((k, v) for k, v in c.items() if kept(k))
                    for c in record["clients"]), key=str) for record in read_metrics(run_dir)]


def worker_steps(logs: Path) -> dict:
    """Mean seconds per message of each step the warm workers time (pull, load, app, push),
    over every message but each worker's first (that one also installs the FAB and builds
    the model): where a warm message's time goes outside the ClientApp."""
    steps: dict[str, list[float]] = {}
    for path in sorted(logs.glob("worker-*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for event in events[1:]:
            for step, seconds in (event.get("stages") or {}).items():
                steps.setdefault(step, []).append(float(seconds))
    return {step: round(float(np.mean(values)), 2) for step, values in steps.items()}


def merge(results: list[dict], parts: list) -> list[dict]:
    """This run's rows plus the rows of earlier parts (``overhead.json`` files) that it did not
    measure again (same model and mode: this run's row wins); refuses parts of another protocol."""
    results = list(results)
    for path in parts:
        done = {(r["model"], r["mode"]) for r in results}
        try:
            part = json.loads(Path(path).read_text())
            part["results"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"overhead --merge: {path} is not an overhead.json ({type(err).__name__}: {err})")
        results += [{"command": part.get("command"), **r} for r in part["results"] if (r["model"], r["mode"]) not in done]
    protocols = {(r.get("clients"), r.get("rounds")) for r in results}
    if len(protocols) > 1:
        raise SystemExit(f"overhead: the parts have different (clients, rounds) {sorted(map(str, protocols))}; "
                         "they do not make one table")
    order = {m: i for i, m in enumerate(MODELS)}
    modes = {m: i for i, m in enumerate(MODES)}
    return sorted(results, key=lambda r: (order.get(r["model"], 99), modes.get(r["mode"], 99)))


def report(results: list[dict], clients: int, rounds: int) -> str:
    commands = list(dict.fromkeys(f"`{r.get('command')}` ({r.get('date', '?')})" for r in results))
    lines = ["# Flower's share of a round", "",
             f"Made by {'; '.join(commands)} on {os.cpu_count()} CPU cores. fedavg-lora on Shakespeare, "
             f"{clients} clients at once, {rounds} rounds; figures are the mean over rounds 2..{rounds} (round 1 also "
             "starts Ray's actors). `client work`: the slowest client's whole work on its train message plus on its "
             "evaluate message (ClientApp entry to reply); `setup`: the part of it outside the method (config, "
             "session: the model built in a new process); `overhead` = round wall time − client work: Flower's "
             "(and Ray's) messaging and process starts, and the server's aggregation.", "",
             "| model | mode | round wall s | client work s | of which setup s | overhead s | overhead % of round |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['mode']} | {r['wall']:.2f} | {r['client_work']:.2f} | {r['setup']:.2f} | "
                     f"{r['overhead']:.2f} | {100 * r['overhead'] / r['wall']:.0f}% |")
    steps = [f"{r['model']}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["worker_steps"].items())
             for r in results if r.get("worker_steps")]
    if steps:
        lines += ["", "Where a warm message's time goes (the workers' own timing, mean per message after each "
                  "worker's first: pulling the message from the SuperNode, loading the app, the ClientApp, pushing "
                  "the reply): " + "; ".join(steps) + "."]
    same = [f"{r['model']}: {'bit-identical' if r['identical_to_cold'] else 'DIFFERENT'}"
            for r in results if r.get("identical_to_cold") is not None]
    if same:
        lines += ["", "Model outputs of the warm worker against the cold deployment's (every loss and metric of "
                  "`metrics.jsonl` but timings and message sizes): " + "; ".join(same) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="deployment: stock Flower (a process per message); warm: with postcard.worker")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs" / "bench-overhead")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "overhead")
    parser.add_argument("--merge", nargs="+", default=[], metavar="OVERHEAD_JSON",
                        help="overhead.json files of earlier parts (same clients and rounds): one table of all "
                             "their rows and this run's, this run's replacing a part's row of the same model and mode")
    args = parser.parse_args(argv)
    command = "python bench/overhead.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    models = ["tiny-llama"] if args.quick else args.models
    started = time.time()
    results = []
    for model in models:
        for mode, runner in MODES.items():
            if mode not in args.modes:
                continue
            run_dir = runner(model, args.clients, args.rounds, args.runs.resolve())
            summary = json.loads((run_dir / "summary.json").read_text())
            if summary.get("status") != "completed":  # `flwr run` exits 0 for a failed run: say so, do not average
                raise SystemExit(f"overhead: the {mode} run of {model} ended {summary.get('status')}: "
                                 f"{summary.get('error')} ({run_dir})")
            rows = rounds_of(run_dir)
            steady = [r for r in rows if r["round"] > 1] or rows
            results.append({"model": model, "mode": mode, "run_dir": str(run_dir), "rounds": rows,
                            **{k: float(np.mean([r[k] for r in steady])) for k in
                               ("wall", "client_work", "method", "setup", "overhead")}})
            r = results[-1]
            if mode == "warm":
                r["worker_steps"] = worker_steps(run_dir.parent / f"cluster-warm-{model}" / "logs")
            cold = [c for c in results if c["model"] == model and c["mode"] == "deployment"]
            if mode == "warm" and cold:
                r["identical_to_cold"] = model_outputs(run_dir) == model_outputs(Path(cold[0]["run_dir"]))
            print(f"[overhead] {model} {mode}: round {r['wall']:.1f} s, slowest client's work {r['client_work']:.1f} s "
                  f"(setup {r['setup']:.1f} s), overhead {r['overhead']:.1f} s = {100 * r['overhead'] / r['wall']:.0f}%",
                  flush=True)
    stamp = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), "clients": args.clients,
             "rounds": args.rounds, "minutes": round((time.time() - started) / 60, 1)}
    results = merge([{**r, **stamp} for r in results], args.merge)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.md").write_text(report(results, args.clients, args.rounds))
    (args.out / "overhead.json").write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
    print(report(results, args.clients, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
