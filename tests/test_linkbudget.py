"""#63 item 6: a run's rounds modelled on real links from its measured bytes and seconds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedapps import linkbudget
from fedapps.linkbudget import LinkProfile

ROOT = Path(__file__).resolve().parent.parent
SLOW = LinkProfile("slow", "1 Mbit/s both ways", up_mbps=1.0, down_mbps=1.0)


def client(up, down, seconds):
    return {"uplink_wire_bytes": up, "train_downlink_message_bytes": down, "train_client-seconds": seconds}


def test_a_round_takes_its_slowest_clients_bytes_over_the_link_plus_its_compute():
    history = [{"round": 0, "clients": [], "eval": {"perplexity": 50.0}},
               {"round": 1, "clients": [client(125_000, 250_000, 2.0), client(125_000, 0, 0.5)], "eval": {"perplexity": 40.0}},
               {"round": 2, "clients": [client(648, 648, 1.0)], "eval": {"perplexity": 35.0}}]
    out = linkbudget.budget(history, "perplexity", False, target=40.0, profiles={"slow": SLOW})
    slow = out["profiles"]["slow"]
    # round 1: the first client, 1 s up + 2 s down + 2 s computing; round 2: 0.005184 s + 1 s
    assert slow["round_seconds"] == {"1": pytest.approx(5.0), "2": pytest.approx(1.0 + 2 * 648 * 8 / 1e6)}
    assert slow["seconds_to_target"] == pytest.approx(5.0) and out["compute_measured"]
    assert linkbudget.table(out).startswith("Link budget (a model:")
    never = linkbudget.budget(history, "perplexity", False, target=10.0, profiles={"slow": SLOW})
    assert never["profiles"]["slow"]["seconds_to_target"] is None
    # accuracy: higher is better
    acc = [{"round": 0, "clients": [], "eval": {"accuracy": 0.2}},
           {"round": 1, "clients": [client(1_000_000, 0, 0.0)], "eval": {"accuracy": 0.6}}]
    assert linkbudget.budget(acc, "accuracy", True, profiles={"slow": SLOW})["profiles"]["slow"]["seconds_to_target"] \
        == pytest.approx(8.0)


def test_every_run_carries_its_link_budget_and_the_cli_prints_it(tmp_path):
    from fedapps.config import compose
    from inprocess import run

    summary = run(compose(["rounds=1", "train.local_steps=2", f"output_dir={tmp_path}"], preset="test"))
    budget = summary["link_budget"]
    assert set(budget["profiles"]) == set(linkbudget.PROFILES) and budget["compute_measured"]
    phone, dc = budget["profiles"]["phone-slow"], budget["profiles"]["datacentre"]
    assert phone["round_seconds"]["1"] > dc["round_seconds"]["1"] > 0  # the same bytes, a slower link
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["link_budget"] == budget
    out = subprocess.run([sys.executable, "-m", "postcard.cli", "link-budget", summary["run_dir"]], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "| phone-slow" in out.stdout and "a model" in out.stdout, out.stderr
    bad = subprocess.run([sys.executable, "-m", "postcard.cli", "link-budget", str(tmp_path / "none")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is not a run folder" in bad.stderr
