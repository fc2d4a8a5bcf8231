"""bench/gpu_check.py on the CPU with the tiny model (what a GPU machine runs at full size: docs/gpu.md)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_the_cpu_check_trains_every_method_and_checks_the_delta_rule(tmp_path):
    out = tmp_path / "check"
    code = gpu_check.main(["--device", "cpu", "--tiny", "--sections", "training", "fednl-kernel", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code == 0, report
    rows = report["sections"]["training"]["rows"]
    assert [r["method"] for r in rows] == list(gpu_check.METHODS)
    assert all(r["tokens_per_s"] > 0 and r["trainable"] > 0 and r["loss"] > 0 for r in rows)
    kernel = report["sections"]["fednl-kernel"]["rows"]
    assert kernel["agreement"]["chunked"]["output_rel_err"] < 1e-5
    assert kernel["agreement"]["chunked"]["grad_rel_err"] < 1e-5
    assert "skipped" in kernel["agreement"]["fla"]  # no CUDA here
    assert {t["tokens"] for t in kernel["timing"]} == {256, 1024}
    assert "## Training" in (out / "report.md").read_text()


def test_the_deployment_section_composes_each_methods_run_and_reports_it(tmp_path, monkeypatch):
    """The deployment runs themselves are what tests/test_deploy.py runs; here each method's run
    config must compose as the ServerApp composes it, and SmartFed's one-adapter pool must open."""
    from fedapps.config import compose_from_run_config
    from fedapps.smartfed import plan_server

    seen = []

    def fake_run_local(nodes, run_config, outputs, folder=None):
        items = dict(item.split("=", 1) for item in shlex.split(run_config))
        cfg = compose_from_run_config(items)
        seen.append(cfg)
        if cfg.algorithm.name == "smartfed":
            plan_server(cfg, on_round_end=None, config_yaml="")  # opens the pool made for it
        run = Path(outputs) / cfg.run_name
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"rounds": 2, "metric": "perplexity", "initial_metric": 9.0,
                                                      "final_metric": 8.0, "uplink_bytes_per_client_round": 648}))
        logs = Path(folder) / "logs"  # what each warm node worker writes, one line per message served
        logs.mkdir(parents=True)
        for node in range(nodes):
            (logs / f"worker-{node}.jsonl").write_text("".join(json.dumps({"served": k, "builds": 1}) + "\n"
                                                               for k in range(1, 6)))
        return 0

    monkeypatch.setattr("postcard.deploy.run_local", fake_run_local)
    settings = gpu_check.Settings(gpu_check.argparse.Namespace(tiny=True, deploy=list(gpu_check.DEPLOY_METHODS),
                                                               model_path=None))
    rows = gpu_check.deployment(settings, gpu_check.torch.device("cpu"), tmp_path)
    assert [r["method"] for r in rows] == ["flite", "fednl", "smartfed"] and all(r["exit"] == 0 for r in rows)
    assert all(r["worker_messages"] == 10 and r["worker_model_builds"] == 2 for r in rows)
    assert all(c.rounds == 2 and c.num_clients == 2 and c.model.name == "tiny-llama" for c in seen)


def test_smollm2_random_is_smollm2s_architecture():
    from transformers import AutoConfig

    from clients import assets
    from clients.models.llm import causal_lm_config
    from fedapps.config import compose

    random_cfg, _ = causal_lm_config(compose(["model=smollm2-random"], preset="none").model)
    real = AutoConfig.from_pretrained(assets.smollm2_checkpoint())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(random_cfg, key) == getattr(real, key), key
    assert random_cfg.rope_parameters["rope_theta"] == pytest.approx(real.rope_parameters["rope_theta"])
