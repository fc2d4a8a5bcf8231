"""`make demo`'s program (postcard.demo): four methods through `flwr run`, one table and one plot.

(#40, overlaps weighed and kept: the CLI sweep (test_cli) is another entry point, Hydra's
`postcard -m`, whose table goes to the sweep's folder; the per-method runs check what one
round of the demo cannot (learning over three rounds, exact payloads, exports). This test's own
claims, the four methods' table and uplink order, FLITE's 648 bytes, the report, are nowhere else.
Its SmartFed pool is a copy of the session's tiny-Llama pool (conftest.tiny_llama_pool: the same two
sources, built once by `postcard pool build`): the demo's build of it was two more runs; the build
step itself, which sources it builds and how, is checked below without them.)
"""

import argparse
import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from postcard.flwr_cli import flower_env
from postcard.superlink import stop as stop_superlinks

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.ray
def test_demo_runs_all_four_methods_and_compares_them(tmp_path, tiny_llama_pool):
    shutil.copytree(tiny_llama_pool[0], tmp_path / "pool")  # the two demo sources, pooled already
    flwr_home = tmp_path / "flwr-home"
    env = flower_env(flwr_home)  # this venv, offline, the local SuperLink ports of this FLWR_HOME
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "postcard.demo", "--model", "tiny-llama", "--clients", "2",
             "--pool", str(tmp_path / "pool"), "--outputs", str(tmp_path / "out"), "--overrides", "train.seq_len=32 rounds=1",
             "--report", str(tmp_path / "report")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
        )
    finally:
        stop_superlinks(flwr_home)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"SmartFed pool {tmp_path / 'pool'}: shakespeare-comedies, shakespeare-histories (already built)" in log
    (demo,) = (tmp_path / "out").iterdir()
    for name in ("comparison.md", "comparison.csv", "comparison.png"):
        assert (demo / name).is_file(), name
    with open(demo / "comparison.csv") as handle:
        rows = {row["algorithm"]: row for row in csv.DictReader(handle)}
    assert list(rows) == ["fedavg-lora", "fednl", "flite", "smartfed"]
    up = {name: float(row["uplink_bytes_per_client_round"]) for name, row in rows.items()}
    assert up["flite"] == 648  # 1,280 int4 latents
    assert up["flite"] < min(up["fednl"], up["smartfed"]) and max(up["fednl"], up["smartfed"]) < up["fedavg-lora"]
    for name, row in rows.items():  # every method learns a little in one short round
        assert float(row["final_metric"]) < float(row["initial_metric"]), name
    assert f"plot: {demo / 'comparison.png'}" in log
    # --report (make bench): the same table as a benchmark report with the command that made it
    report = (tmp_path / "report" / "demo.md").read_text()
    assert "--model tiny-llama" in report and "![perplexity vs cumulative uplink bytes](comparison.png)" in report
    assert (demo / "comparison.md").read_text().strip() in report
    assert (tmp_path / "report" / "comparison.png").read_bytes() == (demo / "comparison.png").read_bytes()


def test_the_demo_builds_the_pool_sources_it_lacks_first(tmp_path, monkeypatch, capsys):
    """SmartFed's pool: the demo sources missing from it are built with `postcard pool build` (the model's,
    the demo's short LoRA runs, beside the demo's runs); none when both are pooled; a failed build stops
    the demo. (The build itself, two federated LoRA runs, is conftest.tiny_llama_pool's.)"""
    from clients import pool as pool_mod
    from postcard import demo
    from postcard import pool as pool_cli

    calls = []
    monkeypatch.setattr(pool_cli, "main", lambda argv: calls.append(argv) or 0)
    folder = tmp_path / "pool"
    args = argparse.Namespace(model="tiny-llama", pool=folder)  # what ensure_pool reads of the parsed arguments
    demo.ensure_pool(args, tmp_path / "demo")
    assert calls == [["build", "--sources", "shakespeare-histories,shakespeare-comedies", "--pool", str(folder),
                      "model=tiny-llama", f"output_dir={tmp_path / 'demo' / 'pool-runs'}", *demo.POOL_OVERRIDES]]
    assert "SmartFed needs a LoRA knowledge pool: building shakespeare-histories, shakespeare-comedies" in \
        capsys.readouterr().out

    class Pooled:  # a pool that already holds the histories
        def __init__(self, path):
            assert path == folder

        def names(self):
            return list(pooled)

    folder.mkdir()
    (folder / pool_mod.POOL_FILE).write_text("{}")
    monkeypatch.setattr(pool_mod, "Pool", Pooled)
    calls.clear()
    pooled = ["shakespeare-histories"]
    demo.ensure_pool(args, tmp_path / "demo")
    assert [c[2] for c in calls] == ["shakespeare-comedies"]  # only what the pool lacks
    calls.clear()
    pooled = ["shakespeare-comedies", "shakespeare-histories"]
    demo.ensure_pool(args, tmp_path / "demo")
    assert calls == [] and "(already built)" in capsys.readouterr().out
    monkeypatch.setattr(pool_cli, "main", lambda argv: 1)
    pooled = []
    with pytest.raises(SystemExit, match="building the SmartFed pool failed"):
        demo.ensure_pool(args, tmp_path / "demo")
