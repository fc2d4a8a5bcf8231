"""Comparison tables and plots over any sweep: a column per swept key, a curve per run."""

import csv
import json

import pytest

from fedapps.comparison import comparison_curves, swept_keys, write_comparison


def _run(tmp_path, name: str, lr: float, algorithm: str = "fedavg-lora", losses=(3.0, 2.0)) -> dict:
    folder = tmp_path / name
    folder.mkdir()
    records = [{"round": 0, "eval": {"perplexity": 70.0}, "clients": []}]
    for i, value in enumerate(losses, start=1):
        records.append({"round": i, "eval": {"perplexity": 70.0 - 10 * i * lr * 1000},
                        "clients": [{"uplink_payload_bytes": 1000, "train_loss": value}]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"algorithm": {"name": algorithm, "lora": {"r": 8}}, "train": {"lr": lr, "local_steps": 4},
              "task": {"name": "shakespeare"}, "output_dir": str(tmp_path), "seed": 0}
    return {"algorithm": algorithm, "task": "shakespeare", "model": "tiny-llama", "partition": "iid",
            "metric": "perplexity", "initial_metric": 70.0, "final_metric": records[-1]["eval"]["perplexity"],
            "uplink_bytes_per_client_round": 1000.0, "wall_seconds": 1.0, "run_dir": str(folder), "config": config}


def test_a_learning_rate_sweep_gets_a_column_and_a_curve_per_run(tmp_path):
    runs = [_run(tmp_path, "a", 1e-3), _run(tmp_path, "b", 1e-2)]
    assert swept_keys(runs) == ["train.lr"]
    curves = comparison_curves(runs, "perplexity")
    assert sorted(curves) == ["fedavg-lora train.lr=0.001", "fedavg-lora train.lr=0.01"]  # two curves, not one
    assert curves["fedavg-lora train.lr=0.01"][-1][1] != curves["fedavg-lora train.lr=0.001"][-1][1]
    write_comparison(runs, tmp_path / "sweep")
    with open(tmp_path / "sweep" / "comparison.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["train.lr"] for row in rows] == ["0.001", "0.01"]
    table = (tmp_path / "sweep" / "comparison.md").read_text().splitlines()
    assert table[0].startswith("| algorithm | train.lr | task")
    assert (tmp_path / "sweep" / "comparison.png").stat().st_size > 0


def test_an_algorithm_sweep_keys_by_algorithm_and_repeats_are_numbered(tmp_path):
    runs = [_run(tmp_path, "a", 1e-3, "fedavg-lora"), _run(tmp_path, "b", 1e-3, "fedprox")]
    runs[1]["config"]["algorithm"]["proximal_mu"] = 0.01  # a group's own keys change with the group
    assert swept_keys(runs) == []
    assert sorted(comparison_curves(runs, "perplexity")) == ["fedavg-lora", "fedprox"]
    repeats = [_run(tmp_path, "c", 1e-3), _run(tmp_path, "d", 1e-3)]
    assert sorted(comparison_curves(repeats, "perplexity")) == ["fedavg-lora #1", "fedavg-lora #2"]


def test_local_training_reports_progress_on_long_work_only():
    import logging

    from clients.tasks import make_task
    from clients.train import local_train, progress_label
    from fedapps.baselines import prepare
    from fedapps.config import compose

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("flwr").addHandler(handler)
    try:
        for every, expected in ((1e-6, 3), (0, 0), (3600, 0)):  # 4 steps: progress after steps 1..3, never, never
            cfg = compose(f"train.local_steps=4 train.progress_seconds={every}", preset="test")
            model, tokenizer, _ = prepare(cfg)
            records.clear()
            local_train(model, make_task(cfg, 0, 2, tokenizer), cfg.train, seed=1)
            lines = [r for r in records if r.startswith("local training:")]
            assert len(lines) == expected, lines
            if expected:
                assert lines[0].startswith("local training: step 1/4, loss ") and lines[0].endswith(" s left")
                assert " s/step, ~" in lines[0]  # the rate and what is left of this message's training
        with progress_label(" (client 1, node 7)"):  # what the ClientApp sets around each message's training
            cfg = compose("train.local_steps=4 train.progress_seconds=1e-6", preset="test")
            records.clear()
            local_train(model, make_task(cfg, 0, 2, tokenizer), cfg.train, seed=1)
            assert [r for r in records if r.startswith("local training (client 1, node 7): step 1/4")], records
    finally:
        logging.getLogger("flwr").removeHandler(handler)


def test_tensorboard_tracking_holds_the_same_numbers_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedapps.config import compose
    from fedapps.outputs import RunDir, read_metrics, round_scalars

    cfg = compose([f"output_dir={tmp_path}", "run_name=tracked", "tracking=tensorboard"], preset="test")
    out = RunDir(cfg)
    records = [
        {"round": 0, "eval": {"perplexity": 70.0, "accuracy": 0.1}, "clients": [], "seconds": 2.0, "refused": [],
         "missing": [], "bounded": []},
        {"round": 1, "eval": {"perplexity": 55.5}, "seconds": 3.5, "missing": [], "bounded": [{"node_id": 2}],
         "refused": [{"node_id": 3}], "clients": [
             {"node_id": 1, "train_loss": 4.0, "uplink_payload_bytes": 100, "train_downlink_payload_bytes": 400},
             {"node_id": 2, "train_loss": 3.0, "uplink_payload_bytes": 300, "train_downlink_payload_bytes": 400}]},
    ]
    for record in records:
        out.write_round(record)
    out.finish(read_metrics(out.path))
    events = EventAccumulator(str(out.path / "tensorboard"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for record in read_metrics(out.path):
        for tag, value in round_scalars(record).items():
            assert abs(scalars[tag][record["round"]] - value) < 1e-4 * max(1.0, abs(value)), tag
    assert scalars["train/loss"] == {1: 3.5} and scalars["bytes/uplink_per_client"] == {1: 200.0}
    assert scalars["eval/perplexity"] == {0: 70.0, 1: 55.5} and scalars["round/refused"][1] == 1.0


def test_tracking_is_off_by_default_and_checked():
    import pytest

    from fedapps.config import ConfigError, compose

    assert compose(preset="test").tracking is None
    with pytest.raises(ConfigError, match="tracking must be null or tensorboard"):
        compose("tracking=wandb", preset="test")


def test_a_saved_adapter_names_its_base_model_portably(tmp_path):
    """The embedded SmolLM2's adapter names the hub id of those weights, not this machine's cache path."""
    from fedapps import baselines
    from fedapps.config import compose

    cfg = compose(["num_clients=2", "algorithm.lora.target_modules=[q_proj]"], model="smollm2")
    plan = baselines.plan_server(cfg, on_round_end=None, config_yaml="")
    plan.save_final(plan.strategy.global_state, tmp_path)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert saved["r"] == cfg.algorithm.lora.r and saved["target_modules"] == ["q_proj"]


def test_a_random_init_models_adapter_names_the_base_saved_beside_it_and_loads_with_auto_peft(tmp_path):
    """A tiny random-init Llama has no hub name: its weights go to run_dir/base_model, which the adapter
    names, so AutoPeftModelForCausalLM loads base + adapter offline, equal to the run's model."""
    import torch
    from peft import AutoPeftModelForCausalLM

    from fedapps import baselines
    from fedapps.config import compose

    cfg = compose(["num_clients=2"], preset="test")
    plan = baselines.plan_server(cfg, on_round_end=None, config_yaml="")
    state = {k: v + 0.01 for k, v in plan.strategy.global_state.items()}  # a non-trivial adapter
    plan.save_final(state, tmp_path)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tmp_path / "base_model")
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    model, _ = baselines.restore(cfg, tmp_path)
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)
    # a truncated adapter is a clear FinalStateError, not a deep traceback
    from fedapps.config import to_yaml
    from fedapps.final import load_run
    from fedapps.method import FinalStateError

    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    adapter = tmp_path / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    with pytest.raises(FinalStateError, match="the final state cannot be read into this run's model"):
        load_run(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(FinalStateError, match="summary.json cannot be read"):
        load_run(tmp_path)


def test_postcard_generate_evaluate_export_refuse_a_folder_without_a_final_model(tmp_path, capsys):
    from postcard.final import main

    assert main(["evaluate", str(tmp_path)]) == 2
    assert "is not a Postcard run folder (no config.yaml)" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("algorithm: {name: fedavg-lora}\n")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": "ConfigError: rounds=0"}))
    assert main(["generate", str(tmp_path), "To be"]) == 2
    assert "holds no final model: the run is failed (ConfigError: rounds=0)" in capsys.readouterr().err


def test_metrics_png_has_integer_round_ticks_and_the_runs_identity_in_its_title(tmp_path):
    """Two rounds used to get ticks at 0, 0.25, ..., 2; the title says which run the plot is of: its
    method, model, task, partition, rounds and seed (#60: the partition, rounds and seed were missing)."""
    import matplotlib.pyplot as plt

    from fedapps.config import compose
    from fedapps.outputs import RunDir, read_metrics, run_figure, run_title

    cfg = compose([f"output_dir={tmp_path}", "run_name=plotted", "rounds=2", "seed=7"], algorithm="flite",
                  preset="test")
    assert run_title(cfg) == "flite · tiny-llama · shakespeare · partition=natural · rounds=2 · seed=7"
    assert run_title(compose(["partition=iid"], preset="test")) == \
        "fedavg-lora · tiny-llama · shakespeare · partition=iid · rounds=3 · seed=42"
    out = RunDir(cfg)
    for r, value in enumerate((70.0, 60.0, 55.0)):
        out.write_round({"round": r, "eval": {"perplexity": value}, "seconds": 1.0, "refused": [], "missing": [],
                         "bounded": [], "clients": [{"node_id": 1, "uplink_payload_bytes": 648}] if r else []})
    out.finish(read_metrics(out.path))
    assert (out.path / "metrics.png").stat().st_size > 0
    fig = run_figure(read_metrics(out.path), "perplexity", run_title(cfg))
    ticks = [t for t in fig.axes[0].get_xticks() if 0 <= t <= 2]
    assert ticks == [0, 1, 2]
    assert fig._suptitle.get_text() == "flite · tiny-llama · shakespeare · partition=natural · rounds=2 · seed=7"
    plt.close(fig)


def test_a_one_round_metrics_png_shows_its_points_on_a_bytes_axis_whose_ticks_do_not_overlap():
    """#60: one round drew a line from 0 across a symlog bytes axis, its ticks "0" and "10⁰" on top of
    each other. Now: markers, round 0 hollow at the first round's bytes, a linear axis under a decade."""
    import matplotlib.pyplot as plt

    from fedapps.outputs import run_figure

    history = [{"round": r, "eval": {"perplexity": value}, "clients": [{"uplink_payload_bytes": 65_536}] if r else []}
               for r, value in ((0, 49_019.0), (1, 48_815.0))]
    fig = run_figure(history, "perplexity", "t")
    bytes_axis = fig.axes[1]
    assert bytes_axis.get_xscale() == "linear"
    points = [(tuple(line.get_xdata()), line.get_marker()) for line in bytes_axis.get_lines()]
    assert points == [((65_536,), "o"), ((65_536,), "o")]  # round 1, and round 0 before any upload
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in bytes_axis.get_xticklabels()
             if label.get_visible() and label.get_text()]
    assert len(boxes) >= 2
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)
    many = [{"round": r, "eval": {"perplexity": 10.0 - r}, "clients": [{"uplink_payload_bytes": 648}] if r else []}
            for r in range(21)]
    fig = run_figure(many, "perplexity")
    assert fig.axes[1].get_xscale() == "log"  # 648 B to 13 kB: a log axis, over a decade
    plt.close(fig)


def test_the_ratio_to_fedavg_lora_is_not_rounded_before_it_is_inverted():
    """648 B against 9,768,960 B is 15,076x fewer (the table said 15,152: the ratio was rounded to 6 decimals)."""
    from fedapps.comparison import comparison_rows

    runs = [{"algorithm": name, "uplink_bytes_per_client_round": up, "config": {}}
            for name, up in (("fedavg-lora", 9_768_960), ("flite", 648))]
    assert comparison_rows(runs)[1]["uplink_vs_fedavg_lora"] == pytest.approx(648 / 9_768_960, rel=1e-5)
    assert f"{1 / comparison_rows(runs)[1]['uplink_vs_fedavg_lora']:,.0f}" == "15,076"


def _modes(folder) -> tuple[dict[str, int], dict[str, int]]:
    """(folder modes, file modes) of everything under ``folder``, itself included, by relative path."""
    import os
    import stat
    from pathlib import Path

    dirs, files = {".": stat.S_IMODE(os.stat(folder).st_mode)}, {}
    for root, subdirs, names in os.walk(folder):
        for name in subdirs:
            dirs[str(Path(root, name).relative_to(folder))] = stat.S_IMODE(os.stat(Path(root, name)).st_mode)
        for name in names:
            files[str(Path(root, name).relative_to(folder))] = stat.S_IMODE(os.stat(Path(root, name)).st_mode)
    return dirs, files


def test_a_run_folder_is_its_users_alone(tmp_path, monkeypatch):
    """#62 finding 8: a run folder (config, metrics, checkpoint, TensorBoard events, plots, the final adapter) was
    world-readable (0755 / 0644). Now 0700 / 0600 (fedapps.filemodes), without touching the process's umask:
    the in-process runner's server runs in this process, as a simulation's runs in a thread of its worker."""
    import os

    from fedapps.config import compose
    from inprocess import run as simulate

    monkeypatch.delenv("POSTCARD_UMASK", raising=False)
    before = os.umask(0o022)  # the usual umask: what a run wrote before
    try:
        summary = simulate(compose([f"output_dir={tmp_path}", "run_name=private", "rounds=1", "train.local_steps=1",
                                    "eval.max_batches=1", "tracking=tensorboard"], preset="test"))
        assert os.umask(0o022) == 0o022  # the process's umask is left alone
    finally:
        os.umask(before)
    dirs, files = _modes(summary["run_dir"])
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoint.npz", "metrics.png"} <= set(files), files
    assert any(f.startswith("tensorboard/") for f in files) and any(f.startswith("adapter/") for f in files), files
    assert set(dirs.values()) == {0o700}, dirs
    assert set(files.values()) == {0o600}, files


def test_postcard_umask_widens_what_a_run_folder_shows(tmp_path, monkeypatch):
    """POSTCARD_UMASK (octal) is the one setting: 027 lets the group read; a value that is no umask is refused."""
    from fedapps import checkpoint
    from fedapps.config import compose
    from fedapps.filemodes import umask
    from fedapps.outputs import RunDir

    monkeypatch.setenv("POSTCARD_UMASK", "027")
    out = RunDir(compose([f"output_dir={tmp_path}", "run_name=shared"], preset="test"))
    checkpoint.save(out.path, server_round=0, cfg=out.cfg, arrays={}, meta={})
    dirs, files = _modes(out.path)
    assert dirs == {".": 0o750} and files == {"config.yaml": 0o640, "checkpoint.npz": 0o640}
    monkeypatch.setenv("POSTCARD_UMASK", "u=rwx")
    with pytest.raises(ValueError, match="POSTCARD_UMASK='u=rwx' is not a umask"):
        umask()
