"""Does a refactor change any number? Each method, two rounds in-process on the test preset, in this
checkout and in another revision's: the global state's SHA-256 and every metric compared.

    .venv/bin/python bench/same_numbers.py --base c8378b4          # ~2 min on 2 cores
    .venv/bin/python bench/same_numbers.py --base HEAD~3 --methods fedavg-lora,flite

The other revision is checked out with ``git worktree`` into a temporary folder (removed after)
and run with this checkout's interpreter. A method runs through the real ClientApp and its real
strategy (``tests/inprocess.py``: two nodes, the tiny random-init Llama), so everything between a
reply and the committed state — screening, bounds, the combine hook, the server step — is on the
path. Timings (``seconds``, ``client-seconds``) are left out of the comparison. Exit 0 when every
method's state and metrics are identical to the bit, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = "fedavg-lora,fedprox,fednl,flite,smartfed"
TIMINGS = {"seconds", "client-seconds"}


def run_methods(names: list[str], out: Path) -> None:
    """In the current checkout (the working directory): each method's two rounds, written to ``out``."""
    import hashlib

    sys.path.insert(0, "tests")
    sys.path.insert(0, ".")
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as tests/conftest.py
    import numpy as np
    from inprocess import context, evaluate_round, pool_overrides, train_round

    from fedapps import registry
    from fedapps.config import compose, to_yaml

    results = {}
    for name in names:
        cfg = compose([*pool_overrides(name, Path(tempfile.mkdtemp())), "rounds=2", "train.local_steps=2"],
                      preset="test", algorithm=name)
        strategy = registry.get(name).plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
        nodes = {1: context(1), 2: context(2)}
        rounds = [{"eval": dict(evaluate_round(cfg, strategy, 0, nodes) or {})}]
        for server_round in (1, 2):
            _, metrics = strategy.aggregate_train(server_round, train_round(cfg, strategy, server_round, nodes))
            rounds.append({"train": dict(metrics or {}),
                           "eval": dict(evaluate_round(cfg, strategy, server_round, nodes) or {})})
        digest = hashlib.sha256()
        for key in sorted(strategy.global_state):
            digest.update(key.encode())
            digest.update(np.ascontiguousarray(strategy.global_state[key]).tobytes())
        results[name] = {"state_sha256": digest.hexdigest(), "rounds": rounds}
    out.write_text(json.dumps(results, default=float))


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _results(checkout: Path, methods: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", methods, "--out", str(out)],
                   cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the revision to compare this checkout with (e.g. a commit before a refactor)")
    parser.add_argument("--methods", default=METHODS, help=f"comma-separated (default {METHODS})")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: run the methods in the working directory
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        run_methods(args.run.split(","), Path(args.out))
        return 0
    if not args.base:
        parser.error("--base REV is required")
    with tempfile.TemporaryDirectory() as folder:
        tree = Path(folder) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            print(f"running {args.methods} at {args.base} and in this checkout ...", flush=True)
            before = _results(tree, args.methods, Path(folder) / "before.json")
            after = _results(ROOT, args.methods, Path(folder) / "after.json")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    same = True
    print(f"{'method':<12} {'state':<10} metrics")
    for name in args.methods.split(","):
        state = before[name]["state_sha256"] == after[name]["state_sha256"]
        metrics = _without_timings(before[name]["rounds"]) == _without_timings(after[name]["rounds"])
        same &= state and metrics
        print(f"{name:<12} {'same' if state else 'DIFFERENT':<10} {'same' if metrics else 'DIFFERENT'}")
    print("identical to the bit" if same else "numbers differ")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
