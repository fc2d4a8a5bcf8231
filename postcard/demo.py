"""``make demo``: the whole mission in one command — four methods, one task, one table.

    python -m postcard.demo                      # SmolLM2-135M, Shakespeare, 4 clients (10-18 min, 2 cores)
    python -m postcard.demo --methods fedavg-lora flite --overrides "rounds=1"
    python -m postcard.demo --model tiny-llama   # a random-init Llama: a wiring check in ~3 min

Runs, one after another, ``flwr run .`` of FedAvg-LoRA (the reference), FedNL, FLITE
(int4 latents) and SmartFed on the same non-IID task: the embedded SmolLM2 learning
Shakespeare, one client per play (``task=shakespeare``, natural partition), with the
``demo`` preset (2 rounds of 4 local steps). SmartFed needs a LoRA knowledge pool: when
the model's pool lacks the two demo sources (Shakespeare histories and comedies, plays
the task does not use), they are built first with ``postcard pool build`` (two short
federated LoRA runs).

Ends with one table (held-out perplexity per method, uplink bytes per client per round,
ratio to FedAvg-LoRA, wall time) and a plot of perplexity against cumulative uplink bytes
per client, in ``<outputs>/demo-<time>/comparison.{md,csv,png}``; each method's own run
folder (metrics.jsonl, summary.json, metrics.png, final state) is next to them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# method -> Hydra overrides of its run (on top of the demo preset)
METHODS = {
    "fedavg-lora": [],
    "fednl": [],
    "flite": ["algorithm.payload=int4", "algorithm.downlink=int4", "train.lr=1e-2"],
    "smartfed": [],
}
POOL_SOURCES = "shakespeare-histories,shakespeare-comedies"
POOL_OVERRIDES = ["rounds=1", "train.local_steps=6", "train.batch_size=4", "train.seq_len=128",
                  "eval.max_batches=1", "train.lr=1e-3"]


def say(message: str) -> None:
    print(f"\n== [demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m postcard.demo", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--model", default="smollm2", help="a conf/model choice (a causal LM); default smollm2")
    p.add_argument("--clients", type=int, default=4, help="simulated SuperNodes (one per play); default 4")
    p.add_argument("--pool", type=Path, default=None,
                   help="SmartFed's knowledge pool folder (default: $POSTCARD_CACHE/pool/<model>)")
    p.add_argument("--overrides", default="", help="extra Hydra overrides for every run, e.g. \"rounds=3\"")
    p.add_argument("--outputs", type=Path, default=Path(os.environ.get("POSTCARD_OUTPUTS", ROOT / "outputs")),
                   help="where the demo folder goes (default ./outputs or $POSTCARD_OUTPUTS)")
    p.add_argument("--report", type=Path, default=None,
                   help="also write the table and plot as a benchmark report in this folder "
                        "(`make bench`: docs/bench/demo, collected into docs/benchmarks.md)")
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error("--clients must be >= 1")
    from fedapps.config import ConfigError, compose

    args.pooled = []  # the methods that read a knowledge pool (their algorithm group has a `pool` key: SmartFed)
    try:  # fail before any run starts: every method's configuration must compose
        for method in args.methods:
            cfg = compose([*run_overrides(args, method)], task="shakespeare", algorithm=method, model=args.model,
                          preset="demo")
            if "pool" in cfg.algorithm:
                args.pooled.append(method)
    except ConfigError as err:
        p.error(str(err))
    return args


def run_overrides(args, method: str) -> list[str]:
    pool = [f"algorithm.pool={args.pool.resolve()}"] if method in getattr(args, "pooled", ()) and args.pool else []
    return [*METHODS[method], *pool, f"num_clients={args.clients}", *shlex.split(args.overrides)]


def ensure_pool(args, demo_folder: Path) -> None:
    """Build the demo's pool sources for this model unless they are pooled already."""
    from postcard import pool as pool_cli

    folder = args.pool.resolve() if args.pool else pool_cli.default_pool_dir(args.model)
    from clients.pool import POOL_FILE, Pool

    have = set(Pool(folder).names()) if (folder / POOL_FILE).is_file() else set()
    missing = [s for s in POOL_SOURCES.split(",") if s not in have]
    if not missing:
        say(f"SmartFed pool {folder}: {', '.join(sorted(have))} (already built)")
        return
    say(f"SmartFed needs a LoRA knowledge pool: building {', '.join(missing)} in {folder}")
    status = pool_cli.main(["build", "--sources", ",".join(missing), "--pool", str(folder), f"model={args.model}",
                            f"output_dir={demo_folder / 'pool-runs'}", *POOL_OVERRIDES])
    if status:
        raise SystemExit(f"demo: building the SmartFed pool failed (exit {status})")


def flwr_run(args, method: str, folder: Path) -> dict:
    """``flwr run .`` of one method (streamed to the console); its summary.json."""
    from postcard.app_run import stream_logs
    from postcard.flwr_cli import flower_env
    from postcard.superlink import SuperLinkBusy, check_free

    env = flower_env()  # this venv first on PATH (`flwr run` starts `flower-superlink` from there), own ports
    try:
        check_free(env)
    except SuperLinkBusy as err:
        raise SystemExit(f"demo: {err}") from None
    flwr = shutil.which("flwr", path=env["PATH"])
    if flwr is None:
        raise SystemExit("demo: the `flwr` command is not installed next to this Python (pip install -e .)")
    overrides = " ".join([f"run_name={method}", f"model={args.model}", *run_overrides(args, method)])
    run_config = (f"algorithm='{method}' task='shakespeare' preset='demo' output-dir='{folder}' "
                  f"overrides='{overrides}'")
    command = [flwr, "run", str(ROOT), "--stream", "--federation-config",
               f"num-supernodes={args.clients} client-resources-num-cpus=1", "--run-config", run_config]
    print("$ " + " ".join(shlex.quote(c) for c in command), flush=True)
    start = time.time()
    returncode = stream_logs(command, env=env, cwd=ROOT)  # less Flower's lines that ask nothing of the user
    seconds = time.time() - start
    summary_path = folder / method / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if returncode != 0 or summary.get("status") != "completed":  # `flwr run --stream` exits 0 either way
        reason = summary.get("error") or f"exit {returncode}"
        raise SystemExit(f"demo: `flwr run` of {method} failed ({reason}); see its log above")
    summary["wall_seconds"] = round(seconds, 1)  # the whole `flwr run`, as the user waited for it
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedapps.comparison import write_comparison

    folder = (args.outputs / f"demo-{dt.datetime.now():%Y%m%d-%H%M%S}").resolve()
    folder.mkdir(parents=True)
    start = time.time()
    if args.pooled:
        ensure_pool(args, folder)
    summaries = []
    for i, method in enumerate(args.methods, 1):
        say(f"[{i}/{len(args.methods)}] {method} on Shakespeare ({args.clients} clients, one per play), "
            f"model {args.model}")
        summaries.append(flwr_run(args, method, folder))
    minutes = (time.time() - start) / 60
    say(f"all {len(args.methods)} methods done in {minutes:.1f} min")
    write_comparison(summaries, folder)
    print(f"\nplot: {folder / 'comparison.png'}\nrun folders: {folder}/<method>/", flush=True)
    if args.report:
        command = " ".join(shlex.quote(a) for a in ["python", "-m", "postcard.demo",
                                                    *(sys.argv[1:] if argv is None else argv)])
        print(f"report: {write_report(folder, args.report, command, minutes)}", flush=True)
    return 0


def write_report(folder: Path, report_dir: Path, command: str, minutes: float) -> Path:
    """The demo's comparison (``folder``) as a benchmark report: ``report_dir/demo.md`` with
    the command, date and wall time, plus ``comparison.png`` and ``comparison.csv``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    for name in ("comparison.png", "comparison.csv"):
        shutil.copyfile(folder / name, report_dir / name)
    table = (folder / "comparison.md").read_text().strip()
    path = report_dir / "demo.md"
    path.write_text("\n".join([
        "# Demo: FedAvg-LoRA, FedNL, FLITE and SmartFed on one task",
        "",
        f"Made by: `{command}`  ",
        f"({dt.datetime.now():%Y-%m-%d %H:%M}, {minutes:.1f} min wall on this machine, pool build included "
        f"when it ran; run folders in `{folder}`.)",
        "",
        "SmolLM2-135M-Instruct learning Shakespeare, one client per play (natural partition), "
        "the `demo` preset; held-out perplexity at round 0 and after the last round, uplink payload "
        "bytes per client per round, ratio to FedAvg-LoRA, wall time of each `flwr run`.",
        "",
        table,
        "",
        "![perplexity vs cumulative uplink bytes](comparison.png)",
        "",
    ]))
    return path


if __name__ == "__main__":
    sys.exit(main())
