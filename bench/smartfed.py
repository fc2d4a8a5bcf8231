"""SmartFed vs FedAvg-LoRA from scratch on a task the knowledge pool has not seen.

    .venv/bin/python bench/smartfed.py                       # SmolLM2, ~30-45 min on 2 cores
    .venv/bin/python bench/smartfed.py --model tiny-llama --rounds 2 --steps 2 --pool-rounds 1 \
        --pool-steps 2 --out /tmp/bench-smoke                  # a smoke test in a few minutes

1. **Pool.** ``postcard pool build`` (the same code) fills a knowledge pool with short
   federated LoRA runs on the ``--pool-sources`` (default: Shakespeare histories and
   comedies, MMLU STEM) in its own folder (``--pool``, default ``RUNS_DIR/pool-<model>``, so
   that the pool is this script's and not whatever earlier runs left in the user's default
   pool); sources already pooled there are reused. The target task's data must
   not be in the pool: the script checks the plays / MMLU categories and stops otherwise.
2. **Runs.** ``fedavg-lora`` (LoRA r=8 on all projections, from scratch) and
   ``smartfed`` (experts from that pool, EEQA budget) train the target task
   (default: Shakespeare on hamlet/macbeth/the-tempest/twelfth-night, one client per play
   group) with the same rounds, clients, local steps, learning rate and seed, as Flower
   simulations.
3. **Client memory.** One client's local training, each algorithm in a fresh process:
   peak resident memory (VmHWM, reset after the backbone is loaded), the part of it
   above the loaded backbone, and the trainable state (values × 4 bytes × 4: weights,
   gradients, two AdamW moments). SmartFed's client gets the round-1 downlink. Measured
   as configured and again with ``train.grad_checkpointing=true`` for both algorithms.

Reported (``OUT/smartfed.md``, ``.json``, ``.png``, with the command that made them):
the metric after R rounds, the first round at which SmartFed reaches FedAvg-LoRA's final
metric, uplink payload bytes per client per round, peak client memory; against the
targets ≤35% of FedAvg-LoRA's uplink bytes, ≤50% of its client memory, metric at least
equal. Extra Hydra overrides after ``--`` apply to both runs (e.g. ``-- train.seq_len=64``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import protocol  # noqa: E402  bench/protocol.py: the one rule for "met"

from postcard import pool as pool_cli  # noqa: E402
from fedapps.config import compose, to_yaml  # noqa: E402
from fedapps.outputs import read_metrics  # noqa: E402
from memory import measure_memory  # noqa: E402 (bench/memory.py)

HIGHER_IS_BETTER = {"accuracy": True, "perplexity": False}


def round1_downlink(cfg) -> dict:
    """What a SmartFed client receives in round 1 (the server's plan, no Flower run)."""
    from fedapps.smartfed import plan_server
    from strategies import codec

    plan = plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg))
    return codec.decode(plan.strategy.downlink_arrays())


# ---------------------------------------------------------------------------- benchmark
def first_round_reaching(values: dict[str, float], goal: float, higher: bool) -> int | None:
    for r in sorted(values, key=int):
        if int(r) > 0 and (values[r] >= goal if higher else values[r] <= goal):
            return int(r)
    return None


def check_unseen(pool_path: Path, target_cfg) -> list[str]:
    """Refuse a benchmark whose target data is in the pool; return what the pool holds."""
    from clients.pool import Pool

    pool = Pool(pool_path)
    held = []
    plays = set(target_cfg.task.get("plays") or [])
    categories = set(target_cfg.task.get("categories") or [])
    for name in pool.names():
        data = pool.provenance(name).get("data") or {}
        overlap = (plays & set(data.get("plays") or [])) if data.get("task") == target_cfg.task.name else set()
        if data.get("task") == "mmlu" and target_cfg.task.name == "mmlu":
            overlap |= categories & set(data.get("categories") or [])
        if overlap:
            raise SystemExit(f"the pool's adapter '{name}' was trained on {sorted(overlap)}, which the target "
                             "task uses: pick other --pool-sources or another --pool")
        held.append(name)
    return held


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = results["metric"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in results["runs"].items():
        rounds = sorted(run["metric_by_round"], key=int)
        values = [run["metric_by_round"][r] for r in rounds]
        axes[0].plot([int(r) for r in rounds], values, marker="o", label=name)
        cumulative = [run["cumulative_uplink_bytes"].get(r, 0) for r in rounds]
        axes[1].plot(cumulative, values, marker="o", label=name)
    axes[0].set(xlabel="round", ylabel=metric, title=f"{results['target']}: {metric} vs round")
    axes[1].set(xlabel="cumulative uplink bytes per client", ylabel=metric, title=f"{metric} vs uplink bytes")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: dict) -> str:
    runs, metric = results["runs"], results["metric"]
    base, sf = runs["fedavg-lora"], runs["smartfed"]
    higher = HIGHER_IS_BETTER.get(metric, True)
    up_ratio = sf["uplink_bytes_per_client_round"] / base["uplink_bytes_per_client_round"]
    # one seed, no interval: by the protocol's rule a point estimate alone is at most "not shown"
    better = protocol.verdict(sf["final_metric"] - base["final_metric"], None, 0.0, kind="non-inferiority",
                              higher_is_better=higher)

    def row(label, b, s, ratio=None, target=None):
        cells = [label, b, s, "-" if ratio is None else f"{ratio:.3f}", target or ""]
        return "| " + " | ".join(cells) + " |"

    reach = sf["rounds_to_fedavg_final"]
    lines = [
        f"# SmartFed vs FedAvg-LoRA: {results['target']} on {results['model']}",
        "",
        f"Made by: `{results['command']}`  ",
        f"({results['date']}, {results['wall_minutes']:.1f} min wall on this machine.)",
        "",
        f"Pool: {results['pool']} — adapters {', '.join(results['pool_adapters'])} "
        f"({sf['smartfed']['pool_experts']} rank-1 experts on {sf['smartfed']['matrices']} matrices); "
        f"SmartFed {sf['smartfed']['mode']}, budget {sf['smartfed']['budget']} active experts, "
        f"top-{results['top_k']}, {results.get('smartfed_payload', 'fp32')} uplink. "
        f"Target data not in the pool: {results['target_data']}.",
        f"Both runs: {results['rounds']} rounds, {results['clients']} clients, {results['steps']} local steps, "
        f"lr {results['lr']}, seed {results['seed']}.",
        "",
        "| | fedavg-lora (from scratch) | smartfed | smartfed / fedavg-lora | target |",
        "|---|---:|---:|---:|---|",
        row(f"{metric} at round 0", f"{base['initial_metric']:.4g}", f"{sf['initial_metric']:.4g}"),
        row(f"{metric} after {results['rounds']} rounds", f"{base['final_metric']:.4g}", f"{sf['final_metric']:.4g}",
            None, f"at least equal: **{better}** (one seed: no interval)"),
        row("rounds to reach fedavg-lora's final metric", str(results["rounds"]),
            f"not within {results['rounds']}" if reach is None else str(reach)),
        row("uplink payload bytes / client / round", f"{base['uplink_bytes_per_client_round']:,.0f}",
            f"{sf['uplink_bytes_per_client_round']:,.0f}", up_ratio,
            f"≤ 0.35: **{'met' if up_ratio <= 0.35 else 'not met'}**"),
        row("downlink payload bytes / client / round", f"{base['downlink_bytes_per_client_round']:,.0f}",
            f"{sf['downlink_bytes_per_client_round']:,.0f}",
            sf["downlink_bytes_per_client_round"] / base["downlink_bytes_per_client_round"]),
    ]
    if results["memory"]:
        mem_b, mem_s = results["memory"]["fedavg-lora"], results["memory"]["smartfed"]
        peak_ratio = mem_s["peak_rss_mb"] / mem_b["peak_rss_mb"]
        state_ratio = mem_s["trainable_state_mb"] / mem_b["trainable_state_mb"]
        lines += [
            row("peak client memory (RSS, MB), same settings", f"{mem_b['peak_rss_mb']:,.0f}",
                f"{mem_s['peak_rss_mb']:,.0f}", peak_ratio, f"≤ 0.50: **{'met' if peak_ratio <= 0.5 else 'not met'}**"),
            row("  of which above the loaded backbone (MB)", f"{mem_b['peak_above_backbone_mb']:,.0f}",
                f"{mem_s['peak_above_backbone_mb']:,.0f}",
                mem_s["peak_above_backbone_mb"] / max(mem_b["peak_above_backbone_mb"], 1e-9)),
            row("  trainable state: weights+grads+AdamW (MB)", f"{mem_b['trainable_state_mb']:,.2f}",
                f"{mem_s['trainable_state_mb']:,.2f}", state_ratio,
                f"≤ 0.50 (the adapter's own memory): **{'met' if state_ratio <= 0.5 else 'not met'}**"),
            row("trainable values on the client", f"{mem_b['trainable_values']:,}", f"{mem_s['trainable_values']:,}",
                mem_s["trainable_values"] / mem_b["trainable_values"]),
        ]
        ck_b, ck_s = results["memory"].get("fedavg-lora+ckpt"), results["memory"].get("smartfed+ckpt")
        if ck_b and ck_s:
            lines += [
                row("peak client memory, both with train.grad_checkpointing (MB)", f"{ck_b['peak_rss_mb']:,.0f}",
                    f"{ck_s['peak_rss_mb']:,.0f}", ck_s["peak_rss_mb"] / ck_b["peak_rss_mb"]),
                row("peak: smartfed checkpointed vs fedavg-lora plain (MB)", f"{mem_b['peak_rss_mb']:,.0f}",
                    f"{ck_s['peak_rss_mb']:,.0f}", ck_s["peak_rss_mb"] / mem_b["peak_rss_mb"],
                    "different settings: not the target's comparison"),
            ]
    lines += [
        "",
        f"{metric} by round:",
        "",
        "| round | " + " | ".join(runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    for r in sorted(base["metric_by_round"], key=int):
        lines.append(f"| {r} | " + " | ".join(f"{run['metric_by_round'].get(r, float('nan')):.4g}" for run in runs.values()) + " |")
    lines += ["", "![metric vs round and vs uplink bytes](smartfed.png)", "",
              "SmartFed's EEQA allocation per round (active experts by projection kind): "
              + "; ".join(f"round {a['for_round']}: {a['quotas_by_kind']}" for a in sf["smartfed_rounds"]), "",
              "Peak memory: one client process's VmHWM (peak resident set) during local training, reset "
              "after the model is loaded, with glibc returning freed blocks >= 64 KiB to the system "
              "(MALLOC_MMAP_THRESHOLD_) so that the peak follows live memory. It includes the fp32 backbone "
              "and the activations kept for backpropagation, which both methods need whole; the trainable "
              "state is the part a method changes. `train.grad_checkpointing=true` keeps only each decoder "
              "layer's input and recomputes the rest in backward (same gradients, tested), for any method.",
              f"Run folders: fedavg-lora `{base['run_dir']}`, smartfed `{sf['run_dir']}`."]
    return "\n".join(lines) + "\n"


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def same_run(saved_yaml: str, cfg, overrides: list[str]) -> bool:
    """Whether a run folder's ``config.yaml`` is this run's: every key it holds has the same value
    here, and the keys it lacks (options added to Postcard since, whose defaults keep the old
    behaviour) are not set by ``overrides``."""
    import yaml
    from omegaconf import OmegaConf

    saved = _flat(yaml.safe_load(saved_yaml) or {})
    ours = _flat(OmegaConf.to_container(cfg, resolve=True))
    if set(saved) - set(ours) or any(saved[k] != ours[k] for k in saved):
        return False
    named = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return not any(k in named or any(k.startswith(f"{n}.") for n in named) for k in set(ours) - set(saved))


def finished_run(cfg, overrides: list[str] = ()) -> dict | None:
    """The summary of a completed run folder under the output root, named after ``cfg.run_name``
    (or its ``-N`` siblings), whose ``config.yaml`` is this run's (:func:`same_run`); None if none."""
    from fedapps.outputs import output_root

    root, name = output_root(cfg), str(cfg.run_name)
    for folder in sorted(root.glob(f"{name}*")):
        if folder.name != name and not (folder.name[len(name):].startswith("-") and folder.name[len(name) + 1:].isdigit()):
            continue
        try:
            summary = json.loads((folder / "summary.json").read_text())
            same = same_run((folder / "config.yaml").read_text(), cfg, list(overrides))
        except (OSError, ValueError):
            continue
        if same and summary.get("status") == "completed":
            return summary
    return None


def run_one(name: str, overrides: list[str], reuse: bool = False) -> dict:
    """One simulation and its summary with cumulative uplink bytes per round; with ``reuse``, a
    completed run of exactly this configuration (:func:`finished_run`) is read instead of run."""
    from fedapps.simulation import simulate

    cfg = compose(overrides, algorithm=name)
    summary = finished_run(cfg, overrides) if reuse else None
    if summary is not None:
        print(f"== {name}: reusing the completed run {summary['run_dir']} (same configuration)", flush=True)
        summary["reused"] = True
    else:
        print(f"== {name}: {' '.join(overrides)}", flush=True)
        summary = simulate(cfg)
    rounds = read_metrics(summary["run_dir"])
    total, cumulative = 0, {}
    for record in rounds:
        ups = [c["uplink_payload_bytes"] for c in record["clients"] if "uplink_payload_bytes" in c]
        total += sum(ups) / max(len(ups), 1)
        cumulative[str(record["round"])] = total
    summary["cumulative_uplink_bytes"] = cumulative
    summary["smartfed_rounds"] = [r.get("smartfed") for r in rounds if r.get("smartfed")]
    summary.pop("config", None)
    return summary


def add_run_arguments(parser) -> None:
    """The options the SmartFed benchmarks share: model, target task, run size, pool."""
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="shakespeare", help="target task (its data must not be in the pool)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="local steps per client per round")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--pool", default=None,
                        help="pool folder (default: RUNS_DIR/pool-<model>, built with this script's settings)")
    parser.add_argument("--pool-sources", default="shakespeare-histories,shakespeare-comedies,mmlu-stem")
    parser.add_argument("--pool-rounds", type=int, default=2)
    parser.add_argument("--pool-steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true",
                        help=f"a check in a few minutes: {' '.join(QUICK)} (onboarding: --seeds 1 too), the report under "
                             "outputs/ unless --out is given; later options still apply")


# --quick: the tiny random-init Llama, one pooled adapter, two short rounds
QUICK = ("--model", "tiny-llama", "--rounds", "2", "--steps", "2", "--pool-sources", "shakespeare-histories",
         "--pool-rounds", "1", "--pool-steps", "2")


def quick_argv(argv: list[str] | None, name: str, more: tuple[str, ...] = ()) -> list[str]:
    """``argv`` with --quick's settings put first (the user's own options after them win) and,
    unless --out is given, the report in ``outputs/<name>`` instead of docs/."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" not in argv:
        return argv
    extra = [*QUICK, *more]
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        extra += ["--out", str(ROOT / "outputs" / name)]
    return extra + argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_run_arguments(parser)
    argv = quick_argv(argv, "bench-smartfed-quick")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--budget-per-matrix", type=float, default=None, help="SmartFed budget (default: config's)")
    parser.add_argument("--mode", default="experts+router", choices=["experts+router", "router-only"])
    parser.add_argument("--smartfed-overrides", default="",
                        help='Hydra overrides for the SmartFed run only, e.g. "algorithm.payload=int4 '
                             'algorithm.budget_per_matrix=12"')
    parser.add_argument("--memory-steps", type=int, default=4, help="local steps of the memory probe (0: skip)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench"), help="where the table, JSON and plot go")
    parser.add_argument("--runs-dir", default=None,
                        help="run folders (default: $POSTCARD_OUTPUTS or ./outputs, then bench-smartfed/)")
    args, extra = parser.parse_known_args(argv)
    extra = [e for e in extra if e != "--"]

    start = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir or Path(os.environ.get("POSTCARD_OUTPUTS") or ROOT / "outputs") / "bench-smartfed")
    runs_dir = runs_dir.expanduser().resolve()
    common = [f"model={args.model}", f"seed={args.seed}", f"output_dir={runs_dir}"]

    # 1. the knowledge pool
    sources = [s for s in args.pool_sources.split(",") if s]
    pool_path = Path(args.pool).expanduser().resolve() if args.pool else runs_dir / f"pool-{args.model}"
    pool_cli.build(sources, [*common, f"rounds={args.pool_rounds}", f"train.local_steps={args.pool_steps}",
                             f"train.lr={args.lr}", f"eval.max_batches={args.eval_batches}"], pool=pool_path)

    # 2. the two runs on the target task
    run = [*common, f"rounds={args.rounds}", f"num_clients={args.clients}", f"train.local_steps={args.steps}",
           f"train.lr={args.lr}", f"eval.max_batches={args.eval_batches}", *extra]
    target = compose([f"task={args.task}", *run])
    held = check_unseen(pool_path, target)
    smartfed = [f"algorithm.pool={pool_path}", f"algorithm.adapters=[{','.join(held)}]", f"algorithm.mode={args.mode}"]
    if args.budget_per_matrix is not None:
        smartfed.append(f"algorithm.budget_per_matrix={args.budget_per_matrix}")
    smartfed += shlex.split(args.smartfed_overrides)
    results_runs = {
        "fedavg-lora": run_one("fedavg-lora", [f"task={args.task}", *run, "run_name=bench-fedavg-lora"]),
        "smartfed": run_one("smartfed", [f"task={args.task}", *run, *smartfed, "run_name=bench-smartfed"]),
    }
    metric = results_runs["fedavg-lora"]["metric"]
    higher = HIGHER_IS_BETTER.get(metric, True)
    goal = results_runs["fedavg-lora"]["final_metric"]
    for summary in results_runs.values():
        summary["rounds_to_fedavg_final"] = first_round_reaching(summary["metric_by_round"], goal, higher)

    # 3. client memory, one fresh process per algorithm
    memory = {}
    sf_cfg = compose([f"task={args.task}", *run, *smartfed], algorithm="smartfed")
    if args.memory_steps > 0:
        downlink = round1_downlink(sf_cfg)
        for suffix, flag in (("", []), ("+ckpt", ["train.grad_checkpointing=true"])):
            print(f"== memory probes{suffix}", flush=True)
            memory["fedavg-lora" + suffix] = measure_memory(
                compose([f"task={args.task}", *run, *flag], algorithm="fedavg-lora"),
                runs_dir / "memory", args.memory_steps, None)
            memory["smartfed" + suffix] = measure_memory(
                compose([f"task={args.task}", *run, *smartfed, *flag], algorithm="smartfed"),
                runs_dir / "memory", args.memory_steps, downlink)

    data = {k: list(v) for k, v in (("plays", target.task.get("plays")),
                                     ("categories", target.task.get("categories"))) if v}
    results = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/smartfed.py",
                                                      *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_minutes": (time.time() - start) / 60,
        "model": args.model, "target": args.task, "target_data": json.dumps(data),
        "rounds": args.rounds, "clients": args.clients, "steps": args.steps, "lr": args.lr, "seed": args.seed,
        "top_k": int(sf_cfg.algorithm.top_k), "smartfed_payload": str(sf_cfg.algorithm.payload),
        "pool": str(pool_path), "pool_adapters": held, "metric": metric,
        "runs": results_runs, "memory": memory,
    }
    return write_outputs(out, "smartfed", results, plot, report)


def write_outputs(out: Path, name: str, results: dict, plot_fn, report_fn) -> int:
    """``OUT/<name>.json``, ``.png`` and ``.md`` (printed too) of a benchmark's results."""
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    plot_fn(results, out / f"{name}.png")
    text = report_fn(results)
    (out / f"{name}.md").write_text(text)
    print(text)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
