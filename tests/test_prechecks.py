"""Refused at once, in one line, before anything starts: a resume folder without a checkpoint, FLITE's
latent budget against the causal LM's layers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedapps.config import ConfigError, compose
from postcard import app_run

ROOT = Path(__file__).resolve().parent.parent


def test_a_resume_folder_without_a_checkpoint_is_refused_before_submitting(tmp_path, capsys):
    missing = tmp_path / "no-run"
    start = time.monotonic()
    status = app_run.main([str(ROOT), "--run-config", f"preset='test' overrides='resume={missing}'"])
    assert status == 2 and time.monotonic() - start < 30  # was: ~36 s, after the SuperLink and ServerApp started
    err = capsys.readouterr().err.strip()
    assert err == (f"postcard.app_run: resume={missing}: {missing}/checkpoint.npz does not exist (give a run folder "
                   "written by a run of this version, or resume=auto with a run_name)")


def test_resume_refusal_cases(tmp_path):
    from fedapps.checkpoint import CHECKPOINT

    def refusal(*overrides, relative=False):
        return app_run.resume_refusal(compose(list(overrides), preset="test"), relative=relative)

    assert refusal() is None
    assert "resume=auto needs a fixed run_name" in refusal("resume=auto")
    assert refusal("resume=auto", "run_name=exp1") is None  # a new folder: the run starts there
    assert refusal(f"resume={tmp_path}") .startswith(f"resume={tmp_path}: ")
    (tmp_path / CHECKPOINT).write_bytes(b"")
    assert refusal(f"resume={tmp_path}") is None  # there: the server reads it (and checks it is this experiment)
    assert refusal("resume=old-run") is None  # relative: the server's own output root decides
    assert "old-run/checkpoint.npz does not exist" in refusal("resume=old-run", f"output_dir={tmp_path}")
    assert "does not exist" in refusal("resume=old-run", relative=True)


def test_postcard_refuses_a_missing_resume_folder_in_one_line(tmp_path):
    out = subprocess.run([str(Path(sys.executable).parent / "postcard"), "preset=test", f"resume={tmp_path}/gone"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"postcard: resume={tmp_path}/gone: {tmp_path}/gone/checkpoint.npz "
                                               "does not exist (give a run folder written by a run of this version, "
                                               "or resume=auto with a run_name)"]


def test_flites_latent_budget_is_checked_against_the_models_layers_at_compose_time():
    """Each norm layer takes algorithm.flite.norm_latents first; every weight layer needs one more."""
    with pytest.raises(ConfigError) as err:
        compose(["algorithm.flite.latent_budget=70"], algorithm="flite", preset="test")
    assert str(err.value) == (
        "FLITE's algorithm.flite.latent_budget=70 is too small for model 'tiny-llama': its 5 norm layers take 60 "
        "latents (algorithm.flite.norm_latents=12 each) and its 14 weight layers need at least one each; set "
        "algorithm.flite.latent_budget >= 74, or algorithm.flite.norm_latents <= 11, or "
        "algorithm.flite.include_norms=false")
    with pytest.raises(ConfigError, match=r"its 241 norm layers take 2892 latents .* >= 3732"):
        compose(["model.random_init.num_hidden_layers=120"], algorithm="flite", preset="test")  # a deep model
    for fix in (["algorithm.flite.latent_budget=74"], ["algorithm.flite.norm_latents=11"],
                ["algorithm.flite.include_norms=false"], ["algorithm.flite.latents=4"]):
        compose(["algorithm.flite.latent_budget=70", *fix] if "latent_budget" not in fix[0] else fix,
                algorithm="flite", preset="test")
    compose(algorithm="flite")  # SmolLM2: 61 norm layers (732 latents) + 210 weight layers fit 1,280


def test_a_superlink_nobody_runs_is_named_in_one_line_with_the_fix(tmp_path):
    """#60: the SuperLink-unavailable message named no fix (and came as Flower's JSON)."""
    from postcard.flwr_cli import flower_env

    (tmp_path / "config.toml").write_text('[superlink]\ndefault = "remote"\n\n[superlink.remote]\n'
                                          'address = "127.0.0.1:9"\ninsecure = true\n')
    out = subprocess.run([sys.executable, "-m", "postcard.app_run", str(app_run.ROOT), "remote", "--run-config",
                          "preset='test'"], env=flower_env(tmp_path), capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "Connection to the SuperLink is unavailable" in lines[0]
    assert f"fix the connection's address in {tmp_path / 'config.toml'}" in lines[0] and "make deploy-local" in lines[0]
