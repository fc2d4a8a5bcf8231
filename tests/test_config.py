"""Config composition: every group choice composes; bad choices and keys fail clearly."""

import os
from pathlib import Path

import pytest

from fedapps.config import GROUPS, ConfigError, choices, compose, compose_from_run_config

VISION = {"cifar10", "fmnist"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("group", GROUPS)
def test_every_choice_composes(group, tmp_path):
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text('{"model_type": "llama"}')
    for choice in choices(group):
        groups = {group: choice}
        overrides = []
        if group == "task" and choice in VISION or group == "model" and choice in {"mobilenetv2", "tiny-cnn", "resnet18-gn"}:
            groups.update(algorithm="fedavg-full")
            if group == "model":
                groups["task"] = "cifar10"
            if choice == "resnet18-gn":  # composes only with its checkpoint named
                overrides.append("model.path=/abs/resnet18_gn.pt")
        if group == "model" and choice == "hf":  # any HF causal LM: composes only with its checkpoint named
            overrides.append(f"model.path={tmp_path / 'my-model'}")
        if group == "base" and choice == "public":  # pretrains a vision backbone on an image task
            groups.update(task="cifar10", model="tiny-cnn", algorithm="fedavg-full")
        if group == "algorithm" and choice == "fedavg-full":
            groups["model"] = "tiny-llama"
        cfg = compose(overrides, **groups)
        if group == "preset":
            continue
        # a model given by its checkpoint is named by itself; model.group keeps its config group
        assert (cfg.model.get("group", cfg.model.name) if group == "model" else cfg[group].name) == choice


def test_overrides_reach_deep_keys():
    cfg = compose("train.lr=1e-4 rounds=2 partition=dirichlet partition.alpha=0.1", algorithm="fedprox")
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.rounds == 2
    assert cfg.partition.name == "dirichlet" and cfg.partition.alpha == pytest.approx(0.1)
    assert cfg.algorithm.proximal_mu > 0


def test_task_picks_its_default_backbone_but_the_user_wins():
    assert compose(task="cifar10", algorithm="fedavg-full").model.name == "mobilenetv2"
    assert compose(["model=tiny-cnn"], task="cifar10", algorithm="fedavg-full").model.name == "tiny-cnn"


def test_algorithm_variants_inherit_lora_settings():
    ffa = compose(algorithm="ffa-lora")
    assert ffa.algorithm.lora.send == "b" and ffa.algorithm.lora.r == compose().algorithm.lora.r


def test_run_config_maps_to_groups_and_overrides():
    cfg = compose_from_run_config(
        {"algorithm": "fedprox", "task": "mmlu", "model": "", "partition": "", "preset": "",
         "overrides": "rounds=5 train.lr=2e-4", "output-dir": "/tmp/somewhere"}
    )
    assert (cfg.algorithm.name, cfg.task.name, cfg.rounds, cfg.output_dir) == ("fedprox", "mmlu", 5, "/tmp/somewhere")
    # every override of the space-separated string applies, not only the first
    assert cfg.train.lr == pytest.approx(2e-4) and compose().train.lr != pytest.approx(2e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(algorithm="fedsgd"), "unknown algorithm .fedsgd.; valid choices: .*fedavg-lora.*fedprox.*ffa-lora"),
        (dict(task="imagenet"), "unknown task .imagenet.; valid choices: cifar10, fmnist, instructions, mmlu, .*shakespeare, text"),
        (dict(overrides="model=gpt5"), "unknown model 'gpt5'"),
        (dict(overrides="train.lrr=1"), "train.lrr"),
        (dict(overrides="rounds=abc"), "rounds must be an integer"),
        (dict(overrides="train.lr=-1"), "train.lr must be > 0"),
        (dict(task="cifar10", algorithm="fednl"), "runs on causal_lm models"),
        (dict(task="cifar10", algorithm="smartfed"), "runs on causal_lm models"),
        (dict(task="mmlu", overrides="model=tiny-cnn algorithm=fedavg-full"), "needs a causal LM"),
        (dict(overrides="partition=dirichlet partition.alpha=-1"), "partition.alpha must be a number > 0"),
        (dict(overrides="model.path=/no/such/checkpoint"), "model.path '/no/such/checkpoint' is not a Hugging Face"),
        (dict(algorithm="smartfed", overrides="secure_aggregation.enabled=true"), "cannot carry algorithm 'smartfed'"),
        (dict(task="cifar10", algorithm="topk-ef", overrides="secure_aggregation.enabled=true"),
         "top-k updates have each client's own support"),
        (dict(overrides="secure_aggregation.enabled=true robust=median"), "secure_aggregation hides every client's update; robust 'median' does not fit"),
        (dict(overrides="secure_aggregation.enabled=true secure_aggregation.threshold=9 num_clients=4"),
         r"threshold must be a majority of the run's 4 clients \(3..4\), got 9"),
        (dict(overrides="secure_aggregation.enabled=true secure_aggregation.threshold=2 num_clients=4"),
         r"threshold must be a majority of the run's 4 clients \(3..4\), got 2"),  # 2 of 4: two disjoint pairs
        (dict(overrides="secure_aggregation.enabled=true secure_aggregation.clip=-1"), "clipping range must be a pos"),
        (dict(overrides="secure_aggregation.enabled=true secure_aggregation.bits=30"), "1..24 bits per value"),
        (dict(overrides="secure_aggregation.enabled=yes"), "secure_aggregation.enabled must be true or false"),
        (dict(algorithm="smartfed", overrides="privacy.mode=central"), "privacy cannot carry algorithm 'smartfed'"),
        (dict(overrides="privacy.mode=local robust=krum"), "robust 'krum' does not fit"),
        (dict(overrides="privacy.mode=central privacy.epsilon=-1"), "privacy.epsilon .* must be a number > 0"),
        (dict(overrides="privacy.mode=everywhere"), "privacy.mode must be off, central or local"),
        (dict(algorithm="smartfed", overrides="algorithm.top_k=0"), r"SmartFed's settings .*top_k must be >= 1, got 0"),
        (dict(algorithm="smartfed", overrides="algorithm.gate_mode=sigmoid"), "gate_mode must be one of"),
        (dict(algorithm="smartfed", overrides="algorithm.importance_decay=1"), r"importance_decay must be in \[0, 1\)"),
        (dict(algorithm="fednl", overrides="algorithm.memory.window=16 algorithm.memory.sink=-1"),
         "invalid algorithm.memory: sink must be a non-negative int, got -1"),
        (dict(algorithm="flite", overrides="algorithm.flite.split=deep"), "invalid algorithm.flite: .*split must be one of"),
        (dict(overrides="task.eval_split=train"), "task.eval_split must be test or val, got 'train'"),
        (dict(overrides="task.eval_split=val task.val_fraction=1.5"), r"task.val_fraction must be null .* in \(0, 1\)"),
        (dict(task="mmlu", overrides="task.eval_split=val"), "unknown config key 'task.eval_split'"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(kwargs, message):
    overrides = kwargs.pop("overrides", "")
    with pytest.raises(ConfigError, match=message):
        compose(overrides, **kwargs)


def test_unknown_run_config_key_is_refused():
    with pytest.raises(ConfigError, match="unknown run-config keys"):
        compose_from_run_config({"algoritm": "fedprox"})


def test_simulated_clients_share_the_visible_gpus_or_get_none(monkeypatch):
    import torch

    from fedapps.simulation import client_resources

    cfg = compose(preset="test")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert client_resources(cfg, 4) == {"num_cpus": 1.0, "num_gpus": 0.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert client_resources(cfg, 4)["num_gpus"] == 0.5
    assert client_resources(cfg, 1)["num_gpus"] == 1.0
    fixed = compose(["simulation.client_gpus=0.25", "simulation.client_cpus=2"], preset="test")
    assert client_resources(fixed, 4) == {"num_cpus": 2.0, "num_gpus": 0.25}
    with pytest.raises(ConfigError, match="simulation.client_gpus 'auto' or a number >= 0"):
        compose(["simulation.client_gpus=-1"], preset="test")


@pytest.mark.parametrize("override", ["train.lrr=1e-3", "+train.lrr=1e-3", "trian.lr=1e-3"])
def test_a_misspelled_key_is_refused_with_the_closest_known_one(override):
    with pytest.raises(ConfigError, match=r"unknown config key '(train\.lrr|trian\.lr)'; did you mean 'train\.lr'"):
        compose(override)


def test_keys_of_the_chosen_groups_are_known():
    assert compose("algorithm.proximal_mu=0.1", algorithm="fedprox").algorithm.proximal_mu == 0.1
    assert compose("robust.byzantine=2", robust="krum").robust.byzantine == 2
    with pytest.raises(ConfigError, match="unknown config key 'algorithm.proximal_muu'"):
        compose("algorithm.proximal_muu=0.1", algorithm="fedprox")


def test_postcard_checks_a_config_before_hydra_and_exits_2(tmp_path):
    import subprocess
    import sys

    def postcard(*args):
        return subprocess.run([sys.executable, "-m", "postcard.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})

    bad = postcard("--cfg", "job", "train.lrr=1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "postcard: unknown config key 'train.lrr'; did you mean 'train.lr' or 'train.threads'?"]
    assert postcard("--cfg", "job", "rounds=0").returncode == 2
    assert postcard("-m", "algorithm=fedavg-lora,fedprx").returncode == 2  # a sweep's choices, before any run
    good = postcard("--cfg", "job", "train.lr=1e-4")
    assert good.returncode == 0 and "lr: 0.0001" in good.stdout
    helped = postcard("--help")
    assert helped.returncode == 0
    assert all(f"{group} (" in helped.stdout for group in GROUPS) and "robust (default, krum" in helped.stdout


def test_a_refused_run_is_logged_in_one_line_under_flower_and_other_errors_keep_their_traceback():
    """Flower logs a ServerApp's exception with its traceback; Postcard's fixable errors become one line."""
    import io
    import logging

    import fedapps.server_app  # noqa: F401  (installs the filter on Flower's logger)
    from fedapps.config import ConfigError
    from flwr.common.logger import log

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("flwr").addHandler(handler)
    try:
        from fedapps.channel import ChannelError

        budget = ChannelError("channel.latents=1280 over 8 federated tensors: a budget of 1280 latents exceeds the 298 "
                              "parameters of the adapted layers (lower channel.latents or raise channel.rank)")
        for error in (ConfigError("unknown config key 'train.lrr'; did you mean 'train.lr'"), budget, KeyError("bug")):
            try:
                raise error
            except Exception as err:
                log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=err)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "ServerApp raised an exception: unknown config key 'train.lrr'; did you mean 'train.lr'"
    # a latent channel's budget the model cannot hold (known once the server builds the model): one line too; it
    # was a 40-line traceback of Flower's simulation process
    assert lines[1] == f"ServerApp raised an exception: {budget}"
    assert lines[2] == "ServerApp raised an exception" and lines[3].startswith("Traceback")


def test_app_run_refuses_what_the_server_would_refuse_before_submitting(tmp_path):
    from postcard.app_run import ROOT, precheck

    assert precheck([str(ROOT), "--run-config", "preset='test' overrides='train.lrr=1'"]) == \
        "unknown config key 'train.lrr'; did you mean 'train.lr' or 'train.threads'?"
    assert "unknown algorithm 'fedsgd'" in precheck([str(ROOT), "--run-config", "algorithm='fedsgd'"])
    assert precheck([str(ROOT), "--federation-config", "num-supernodes=3", "--run-config", "preset='test'"]) == (
        "--federation-config num-supernodes=3 but the run has num_clients=2: pass num-supernodes=2, or set "
        "num_clients=3 (overrides='num_clients=3')")
    toml = tmp_path / "run.toml"  # the `postcard` CLI passes its run config as a file
    toml.write_text('preset = "test"\noverrides = "rounds=0"\n')
    assert "rounds" in precheck([str(ROOT), "--run-config", str(toml)])
    assert precheck([str(ROOT), "--federation-config", "num-supernodes=2", "--run-config", "preset='test'"]) is None
    assert precheck([str(tmp_path), "--run-config", "algorithm='fedsgd'"]) is None  # another app: its own checks


def test_smartfed_tuned_preset_is_the_setting_the_onboarding_benchmark_measured():
    """docs/smartfed.md's 3-seed variant ran `algorithm=smartfed train.lr=1e-3` with these overrides;
    `preset=smartfed-tuned` must train and send exactly that, whatever train.lr is."""
    measured = compose("train.lr=1e-3 algorithm.lr.experts=3e-3 algorithm.payload=int4 algorithm.budget_per_matrix=12 "
                       "algorithm.downlink=int4 algorithm.top_k=4", algorithm="smartfed").algorithm
    for lr in ("1e-3", "3e-4"):
        tuned = compose(f"train.lr={lr}", preset="smartfed-tuned").algorithm
        assert tuned.name == "smartfed"
        assert {k: tuned[k] for k in ("payload", "budget_per_matrix", "downlink", "top_k")} == \
            {k: measured[k] for k in ("payload", "budget_per_matrix", "downlink", "top_k")}
        assert tuned.lr.experts == pytest.approx(3e-3) and tuned.lr.router == pytest.approx(1e-3)


def test_fednl_passkey_preset_is_the_setting_the_gate_runs_chose():
    """docs/fednl.md's run i: `--fednl-overrides` of key centring, identity, gate init -2 and the gate's and
    β's own rates on a 64-token window + 4 sinks, 6 rounds x 10 steps of one 512-token prompt."""
    cfg = compose(preset="fednl-passkey")
    memory = cfg.algorithm.memory
    assert cfg.algorithm.name == "fednl" and cfg.task.name == "passkey"
    assert (memory.window, memory.sink, memory.key_centering, memory.qk_activation) == (64, 4, True, "identity")
    assert memory.gate_init_logit == pytest.approx(-2.0)
    assert cfg.algorithm.lr.gate == pytest.approx(0.1) and cfg.algorithm.lr.beta == pytest.approx(0.01)
    assert (cfg.rounds, cfg.train.local_steps, cfg.train.batch_size, list(cfg.task.train_lengths)) == (6, 10, 1, [512])
    assert cfg.train.lr == pytest.approx(1e-3) and list(memory.layers) == [11, 12, 14, 17, 18, 21, 23, 26]
    ablation = compose("algorithm.ablate_memory=true", preset="fednl-passkey")
    assert ablation.algorithm.ablate_memory and ablation.algorithm.memory.window == 64


def test_fednl_memory_layers_compose_and_bad_ones_fail_when_composed():
    from fedapps.fednl import memory_config

    assert memory_config(compose("algorithm.memory.layers=[18,12]", algorithm="fednl")).layers == (12, 18)
    assert memory_config(compose(algorithm="fednl")).layers is None
    for bad in ("algorithm.memory.layers=[]", "algorithm.memory.layers=[3,3]", "algorithm.memory.layers=[-1]"):
        with pytest.raises(ConfigError, match="layers"):
            compose(bad, algorithm="fednl")


@pytest.mark.parametrize("preset", choices("preset"))
def test_every_preset_reaches_the_server_as_the_cli_composes_it(preset):
    """#60: through `flwr run .` the app's [tool.flwr.app.config] defaults are fused with --run-config
    (Flower's own fusing) and the server composes that; a default there (once algorithm='fedavg-lora',
    task='shakespeare') beat every preset's `override /algorithm` and `override /task`, so
    `postcard preset=fednl-cpu` trained FedAvg-LoRA on Shakespeare. The server's config must be the
    CLI's, key for key."""
    from flwr.common.config import get_fused_config_from_dir, parse_config_args
    from omegaconf import OmegaConf

    fused = get_fused_config_from_dir(ROOT, parse_config_args([f"preset='{preset}'"]))
    server = OmegaConf.to_container(compose_from_run_config(fused))
    cli = OmegaConf.to_container(compose([f"preset={preset}"]))
    assert server == cli
    body = OmegaConf.load(ROOT / "conf" / "preset" / f"{preset}.yaml")
    for entry in body.get("defaults", []):  # the method and task the preset names are the ones composed
        for key, value in entry.items():
            group = key.replace("override", "").strip().lstrip("/")
            assert server[group]["name"] == value, (group, value)


def test_the_documented_fednl_preset_composes_fednl_on_mmlu_in_postcard_cfg_job():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "postcard.cli", "preset=fednl-cpu", "rounds=1", "--cfg", "job"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    from omegaconf import OmegaConf

    printed = OmegaConf.create(out.stdout)
    assert (printed.algorithm.name, printed.task.name, printed.rounds) == ("fednl", "mmlu", 1)


def test_a_user_preset_with_an_unknown_key_is_refused_naming_the_file(tmp_path):
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /task: instructions\n"
        "rounds: 2\ntask:\n  prompt: 'Q: {question}'\ntrain:\n  lrr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"preset 'mine' \(.*mine.yaml\) sets unknown config key 'train.lrr'; "
                                          r"did you mean 'train.lr'"):
        compose(["preset=mine"], conf_path=[tmp_path])
    # the same preset without the typo: the task it names, its keys applied
    (tmp_path / "preset" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /task: instructions\nrounds: 2\n")
    cfg = compose(["preset=mine"], conf_path=[tmp_path])
    assert (cfg.task.name, cfg.rounds) == ("instructions", 2)


def test_config_dir_of_ones_own_reaches_the_cli_and_the_server(tmp_path):
    """#60: `postcard --config-dir DIR` failed (a preset of one's own was an unknown choice); now the CLI,
    Hydra and the server (run config `config-dir`) all search DIR after conf/."""
    import subprocess
    import sys

    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /algorithm: fednl\n"
                                                  "rounds: 1\n")
    out = subprocess.run([sys.executable, "-m", "postcard.cli", "--config-dir", str(tmp_path), "preset=mine", "--cfg",
                          "job"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name: fednl" in out.stdout and "rounds: 1" in out.stdout
    server = compose_from_run_config({"preset": "mine", "config-dir": str(tmp_path)})
    assert (server.algorithm.name, server.rounds) == ("fednl", 1)
    (tmp_path / "preset" / "mine.yaml").write_text("# @package _global_\nrounds: 1\ntrain:\n  lrr: 1\n")
    bad = subprocess.run([sys.executable, "-m", "postcard.cli", "--config-dir", str(tmp_path), "preset=mine"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("postcard: preset 'mine'") and \
        "unknown config key 'train.lrr'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="config-dir '/no/such' is not a folder"):
        compose_from_run_config({"config-dir": "/no/such"})
