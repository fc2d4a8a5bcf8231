"""Compose the run configuration with Hydra from ``conf/`` (no ``@hydra.main`` inside apps).

One function, :func:`compose`, is used by the ServerApp (from Flower's ``run_config``),
by the ``postcard`` CLI and by tests, so a run means the same thing however it starts.
"""

from __future__ import annotations

import difflib
import functools
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algorithm", "task", "model", "partition", "preset", "robust", "base", "channel")
# run_config keys (pyproject [tool.flwr.app.config]) that are not Hydra groups
RUN_CONFIG_KEYS = (*GROUPS, "overrides", "output-dir")


class ConfigError(ValueError):
    """A configuration that cannot be composed; the message lists the valid choices."""


def choices(group: str) -> list[str]:
    """The options of a config group, i.e. the yaml files in ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_choice(group: str, value: str) -> None:
    valid = choices(group)
    if value not in valid:
        raise ConfigError(f"unknown {group} '{value}'; valid choices: {', '.join(valid)}")


def compose(overrides: Sequence[str] | str = (), **groups: str | None) -> DictConfig:
    """Compose ``conf/config.yaml`` with group choices and Hydra overrides.

    ``compose(["train.lr=1e-4"], algorithm="fedprox", task="mmlu")``; empty or ``None``
    group values keep the defaults. Raises :class:`ConfigError` for an unknown group
    choice or key, naming what is valid.
    """
    if isinstance(overrides, str):
        overrides = shlex.split(overrides)
    items: list[str] = []
    for group, value in groups.items():
        if group not in GROUPS:
            raise ConfigError(f"unknown config group '{group}'; valid groups: {', '.join(GROUPS)}")
        if value:
            _check_choice(group, str(value))
            items.append(f"{group}={value}")
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in GROUPS and "=" in item:
            _check_choice(key, item.split("=", 1)[1])
    _check_keys(items + [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS], overrides)
    items.extend(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="postcard"):
            cfg = hydra_compose(config_name="config", overrides=items)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err)) from None
    return finalize(cfg)


def check_overrides(overrides: Sequence[str]) -> None:
    """Group choices and keys of command-line overrides, before Hydra sees them (a sweep's
    ``key=a,b`` is checked per choice); ConfigError names the fix."""
    groups = []
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if key in GROUPS and value:
            for choice in value.split(","):
                _check_choice(key, choice)
            groups.append(f"{key}={value.split(',')[0]}")
    _check_keys(groups, overrides)


@functools.lru_cache(maxsize=32)
def _known_keys(group_items: tuple[str, ...]) -> frozenset[str]:
    """Every dotted key (inner nodes too) of the config these group choices compose to."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="postcard"):
        base = OmegaConf.to_container(hydra_compose(config_name="config", overrides=list(group_items)))
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            keys.add(prefix + str(key))
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")

    walk(base, "")
    return frozenset(keys)


def _check_keys(group_items: list[str], overrides: Sequence[str]) -> None:
    """Every override names a key the chosen groups have (``+key`` too: a typo is never added);
    an unknown one is refused with the closest known keys."""
    known = None
    for item in overrides:
        if "=" not in item:
            continue
        key = item.split("=", 1)[0].lstrip("+~")
        if key in GROUPS or key.startswith("hydra.") or "/" in key:
            continue
        if known is None:
            known = _known_keys(tuple(sorted(group_items)))
        if key in known:
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if parent and parent not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
        else:
            siblings = sorted(k for k in known if k != parent and (k.rsplit(".", 1)[0] == parent if parent else "." not in k))
            close = difflib.get_close_matches(key, siblings, n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else \
            " (`postcard --cfg job` prints every key)"
        raise ConfigError(f"unknown config key '{key}'{hint}")


def _explain(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines else type(err).__name__
    if "not in struct" in str(err):
        text += " (check the key's spelling against `postcard --cfg job`)"
    return f"invalid configuration: {text}"


# keys whose values must be numbers: (dotted key, type, lower bound)
_NUMERIC = (
    ("rounds", int, 1),
    ("num_clients", int, 1),
    ("seed", int, 0),
    ("train.lr", float, 0.0),
    ("train.local_steps", int, 1),
    ("train.batch_size", int, 1),
    ("train.seq_len", int, 2),
    ("train.logit_chunk", int, 0),
    ("eval.batch_size", int, 1),
    ("eval.max_batches", int, 0),
)


def _check_numbers(cfg: DictConfig) -> None:
    for key, kind, low in _NUMERIC:
        value = OmegaConf.select(cfg, key)
        if value is None and key == "num_clients":
            continue  # resolved at run start: the task's default_clients (fedapps.runner.client_count)
        try:
            number = kind(value)
            if isinstance(value, bool) or (kind is int and float(value) != number):
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
        if number < low or (kind is float and number == low == 0.0):
            raise ConfigError(f"{key} must be {'>' if kind is float else '>='} {low}, got {value!r}")


def _check_learning_rates(algorithm) -> None:
    """``algorithm.lr`` (a method's learning rates of its own, by parameter kind): each null or > 0."""
    rates = algorithm.get("lr")
    if rates is None:
        return
    for key, value in rates.items():
        if value is None:
            continue
        try:
            ok = not isinstance(value, bool) and float(value) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"algorithm.lr.{key} must be null (= train.lr) or a number > 0, got {value!r}")


def compose_from_run_config(run_config: Mapping[str, object]) -> DictConfig:
    """Flower ``context.run_config`` (pyproject keys + ``--run-config``) -> composed config."""
    unknown = sorted(set(run_config) - set(RUN_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"unknown run-config keys {unknown}; valid keys: {', '.join(RUN_CONFIG_KEYS)}")
    overrides = shlex.split(str(run_config.get("overrides", "") or ""))
    output_dir = str(run_config.get("output-dir", "") or "")
    if output_dir:
        overrides.append(f"output_dir={output_dir}")
    return compose(overrides, **{g: str(run_config.get(g, "") or "") for g in GROUPS})


def finalize(cfg: DictConfig) -> DictConfig:
    """Fill the derived defaults (client count) and check cross-group consistency."""
    OmegaConf.set_struct(cfg, False)
    _check_numbers(cfg)
    kind = cfg.model.kind
    if cfg.task.kind in ("lm", "mcq") and kind != "causal_lm":
        raise ConfigError(f"task '{cfg.task.name}' needs a causal LM, but model '{cfg.model.name}' is {kind}")
    if cfg.task.kind == "image" and kind != "vision":
        raise ConfigError(f"task '{cfg.task.name}' needs a vision model, but model '{cfg.model.name}' is {kind}")
    if cfg.model.get("arch") == "resnet18_gn" and cfg.model.get("pretrained") and not cfg.model.get("path"):
        raise ConfigError("model resnet18-gn needs a checkpoint: model.path=/abs/path/to/resnet18_gn.pt "
                          "(no package ships ResNet-18-GN weights), or model.pretrained=false base=public to "
                          "pretrain it from a random init on the task's public split")
    _check_base(cfg)
    _check_text_task(cfg)
    allowed = cfg.algorithm.get("models")
    if allowed and kind not in allowed:
        raise ConfigError(f"algorithm '{cfg.algorithm.name}' runs on {' or '.join(map(str, allowed))} models, but "
                          f"model '{cfg.model.name}' is {kind}")
    if cfg.algorithm.trainable == "lora" and kind not in ("causal_lm", "vision"):
        raise ConfigError(f"algorithm '{cfg.algorithm.name}' adapts a causal LM or a vision backbone; "
                          f"use fedavg-full for '{cfg.model.name}'")
    _apply_channel(cfg)
    _check_uplink(cfg.algorithm)
    _check_learning_rates(cfg.algorithm)
    if cfg.get("tracking") not in (None, "tensorboard"):
        raise ConfigError(f"tracking must be null or tensorboard, got {cfg.get('tracking')!r}")
    _check_partition(cfg.partition)
    _check_model_path(cfg.model)
    _label_model(cfg.model)
    _check_robust(cfg)
    _check_router_rounds(cfg.algorithm)
    _check_server_optimizer(cfg)
    _check_reply(cfg.algorithm)
    _check_smartfed(cfg)
    _check_fednl_memory(cfg)
    _check_flite(cfg)
    _check_flite_budget(cfg)
    _check_secure(cfg)
    _check_privacy(cfg)
    _check_simulation(cfg.get("simulation") or {})
    for key in ("train.bf16", "train.grad_checkpointing"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    OmegaConf.set_struct(cfg, True)
    return cfg


def _check_base(cfg: DictConfig) -> None:
    """``base=public`` needs an image task with a public split to pretrain on."""
    fraction = cfg.task.get("public_fraction", 0.0) or 0.0
    if cfg.task.kind == "image" and not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ConfigError(f"task.public_fraction must be a number in [0, 1), got {fraction!r}")
    if cfg.base.name != "public":
        return
    if cfg.task.kind != "image":
        raise ConfigError(f"base=public pretrains a vision backbone on an image task's public split; task "
                          f"'{cfg.task.name}' is {cfg.task.kind} (use base=model)")
    if not fraction:
        raise ConfigError("base=public needs a public split: task.public_fraction > 0 (e.g. 0.2)")
    for key in ("steps", "batch_size"):
        value = cfg.base.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"base.{key} must be an integer >= 1, got {value!r}")
    if not isinstance(cfg.base.get("lr"), (int, float)) or cfg.base.lr <= 0:
        raise ConfigError(f"base.lr must be a number > 0, got {cfg.base.get('lr')!r}")


def _check_text_task(cfg: DictConfig) -> None:
    """``kind: text`` (``task=text``, ``task=instructions``: clients.tasks.local): the settings, and that
    ``task.path`` names data, before any client starts (its fields are checked when a client reads it)."""
    task = cfg.task
    if task.kind != "text":
        return
    from clients.tasks.base import TaskError
    from clients.tasks.local import FORMATS, METRICS, SAMPLE_BY, data_files

    if cfg.model.kind != "causal_lm":
        raise ConfigError(f"task '{task.name}' needs a causal LM, but model '{cfg.model.name}' is {cfg.model.kind}")
    instructions = task.get("prompt") is not None
    if instructions != (task.get("response") is not None):
        raise ConfigError("instruction data need both task.prompt and task.response (templates over the row's "
                          "fields, e.g. task.prompt='{question}' task.response=' {answer}'); plain text: neither")
    if task.get("metric") not in METRICS:
        raise ConfigError(f"task.metric must be one of {', '.join(METRICS)}, got {task.get('metric')!r}")
    if task.metric == "accuracy" and not instructions:
        raise ConfigError("task.metric=accuracy scores responses: set task.prompt and task.response "
                          "(task=instructions), or use task.metric=perplexity")
    if task.get("chat") and not instructions:
        raise ConfigError("task.chat=true renders prompt and response through the chat template: set task.prompt "
                          "and task.response")
    if not instructions and not task.get("text"):
        raise ConfigError("task.text must be a template over the row's fields, e.g. '{text}'")
    for key, choices_ in (("format", FORMATS), ("sample_by", SAMPLE_BY)):
        if task.get(key) not in choices_:
            raise ConfigError(f"task.{key} must be one of {', '.join(choices_)}, got {task.get(key)!r}")
    fraction = task.get("test_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(f"task.test_fraction must be a number in (0, 1), got {fraction!r}")
    for key, low in (("max_length", 2), ("max_examples", 2), ("default_clients", 1)):
        value = task.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"task.{key} must be {'null or ' if key != 'default_clients' else ''}an integer "
                              f">= {low}, got {value!r}")
    try:
        data_files(task.get("path"), str(task.format))
    except TaskError as err:
        raise ConfigError(str(err)) from None


def _check_partition(partition) -> None:
    """Dirichlet's concentration and minimum size, before any client loads data."""
    if partition.name != "dirichlet":
        return
    alpha, size = partition.get("alpha"), partition.get("min_partition_size", 10)
    try:
        ok = float(alpha) > 0 and not isinstance(alpha, bool)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"partition.alpha must be a number > 0 (smaller = more skewed), got {alpha!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"partition.min_partition_size must be an integer >= 0, got {size!r}")


def _check_model_path(model) -> None:
    """A causal LM's ``model.path`` that names a local folder must be a checkpoint folder (a hub id is left to
    the online user), ``model.gguf`` a file, not both; ``model=hf`` needs one of them. Checked here, not on
    every client after the run started."""
    if model.get("kind") != "causal_lm":  # a vision model's path is a .pt file, checked on load
        return
    path, gguf = model.get("path"), model.get("gguf")
    if path and gguf:
        raise ConfigError("model.path and model.gguf both name the weights; give one (model.gguf=FILE is converted "
                          "once; `postcard convert --gguf FILE --out DIR` then model.path=DIR does it yourself)")
    if gguf:
        if not Path(str(gguf)).expanduser().is_file():
            raise ConfigError(f"model.gguf '{gguf}' is not a file; give a .gguf file (absolute path)")
        return
    if not path:
        if str(model.get("name")) == "hf" and not model.get("random_init"):
            raise ConfigError("model=hf needs the model: model.path=/abs/hf/checkpoint (a folder with config.json, "
                              "the weights and the tokenizer) or model.gguf=/abs/file.gguf")
        return
    text = str(path)
    local = text.startswith(("/", ".", "~")) or Path(text).expanduser().exists()
    if local and not (Path(text).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path '{text}' is not a Hugging Face checkpoint folder (no config.json there); "
                          "give a folder holding config.json and the weights (`postcard convert --gguf FILE --out "
                          "DIR` makes one from a GGUF file), or drop model.path for the embedded SmolLM2-135M")


def _label_model(model) -> None:
    """A causal LM given by ``model.path`` or ``model.gguf`` is named by itself, not by its config group:
    ``model.name`` becomes the checkpoint's own name (``clients.models.llm.checkpoint_label``: its
    config's ``_name_or_path``, the folder's name, or a fingerprint) or the GGUF file's, and
    ``model.group`` keeps the group it was composed from (``model=hf``, ``model=smollm2``). So runs of
    two checkpoints differ in their logs, run folders, ``summary.json`` and SmartFed's default pool."""
    if model.get("kind") != "causal_lm" or model.get("random_init"):
        return  # a random init's path holds only its tokenizer: the group names the model
    from clients.models.names import checkpoint_label, gguf_label

    if model.get("path"):
        label = checkpoint_label(model.path)
    elif model.get("gguf"):
        label = gguf_label(model.gguf)
    else:
        return
    if "group" not in model:
        model.group = str(model.name)
    model.name = label


def _check_robust(cfg: DictConfig) -> None:
    """The ``robust`` group builds (strategies.robust.Robustness) and suits the algorithm."""
    from strategies.robust import Robustness

    try:
        settings = Robustness.from_mapping(OmegaConf.to_container(cfg.robust, resolve=True))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.algorithm.name == "smartfed" and settings.aggregator != "mean":
        raise ConfigError(f"algorithm 'smartfed' combines sparse expert updates by the weighted mean only; "
                          f"robust '{settings.aggregator}' does not apply (use robust=default or robust=off)")


def _check_router_rounds(algorithm) -> None:
    """SmartFed's ``router_rounds``: null, or the rounds (>= 1) its routers train before they are frozen."""
    if "router_rounds" not in algorithm or algorithm.router_rounds is None:
        return
    value = algorithm.router_rounds
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"algorithm.router_rounds must be null (train the routers every round) or an integer "
                          f">= 1, got {value!r}")
    if str(algorithm.get("mode")) == "router-only":
        raise ConfigError("algorithm.router_rounds freezes the routers, but mode=router-only trains nothing else; "
                          "use mode=experts+router")


def _check_server_optimizer(cfg: DictConfig) -> None:
    """``strategy.server_optimizer`` builds (strategies.server_opt.ServerOptimizer) and suits the algorithm."""
    from strategies.server_opt import ServerOptimizer

    block = cfg.strategy.get("server_optimizer")
    try:
        settings = ServerOptimizer.from_mapping(None if block is None else OmegaConf.to_container(block, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if cfg.algorithm.name == "smartfed" and not settings.plain:
        raise ConfigError(f"algorithm 'smartfed' applies its sparse expert updates as they are; "
                          f"strategy.server_optimizer.name={settings.name!r} is not supported (use fedavg)")


def _check_smartfed(cfg: DictConfig) -> None:
    """SmartFed's MoRE layer settings (``top_k``, ``mode``, ``gate_mode``, ``importance``, ...) as its
    clients will build them (``fedapps.smartfed.more_config``): a bad value fails here, not when a model is built."""
    if cfg.algorithm.name != "smartfed":
        return
    from fedapps.smartfed import more_config

    try:
        more_config(cfg)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"SmartFed's settings (algorithm.*): {err}") from None


def _check_fednl_memory(cfg: DictConfig) -> None:
    """FedNL's ``algorithm.memory`` as its clients will build it (``fedapps.fednl.memory_config``):
    a bad window, sink or gate fails here, not after the simulation has started."""
    if cfg.algorithm.name != "fednl":
        return
    from fedapps.fednl import FedNLSetupError, memory_config

    try:
        memory_config(cfg)
    except FedNLSetupError as err:
        raise ConfigError(str(err)) from None


def _check_flite(cfg: DictConfig) -> None:
    """FLITE's ``algorithm.flite`` as its clients will build it (``fedapps.flite.flite_config``): a bad
    split, rank or budget fails here, not after the simulation has started."""
    if cfg.algorithm.name != "flite":
        return
    from fedapps.flite import flite_config

    try:
        config = flite_config(cfg, measure=False).validate()
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid algorithm.flite: {err}") from None
    if config.split == "sensitivity" and (cfg.base.name != "public" or cfg.model.kind != "vision"):
        raise ConfigError("algorithm.flite.split=sensitivity shares the latents by θ_pre's gradient norms on the "
                          "public split: it needs base=public (a vision task with task.public_fraction > 0)")
    if config.sensitivity is not None:
        raise ConfigError("algorithm.flite.sensitivity is measured (split=sensitivity with base=public), not set")


@functools.lru_cache(maxsize=16)
def _flite_layers(model_yaml: str, flite_json: str) -> tuple[list[tuple[str, int]], str | None]:
    """``([(kind, parameters)] of the layers FLITE adapts, plan error or None)`` for a causal LM built on
    the meta device (its config only: no weights are read)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from clients.flite.config import FliteConfig
    from clients.flite.model import _candidates, _matrix_shape, _norm_params, plan
    from clients.models.llm import causal_lm_config

    config, _ = causal_lm_config(OmegaConf.create(model_yaml))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    flite = FliteConfig.from_dict(json.loads(flite_json))
    layers = []
    for _, module, kind in _candidates(model, flite):
        m, n = _matrix_shape(module, kind, _norm_params(module) if kind == "norm" else ("weight",))
        layers.append((kind, m * n))
    try:
        plan(model, flite)
    except ValueError as err:
        return layers, str(err)
    return layers, None


def _check_flite_budget(cfg: DictConfig) -> None:
    """FLITE's latent budget against the causal LM's layers, at compose time: each norm layer takes
    ``algorithm.flite.norm_latents`` from ``algorithm.flite.latent_budget`` first and every weight
    layer needs at least one of the rest, so a deep model (Gemma-3: 6 norms a layer) can exceed the
    default 1,280 — refused here with the settings that fit, not by every client after the start."""
    if cfg.algorithm.name != "flite" or cfg.model.kind != "causal_lm":
        return
    import json

    from clients.models.llm import ModelError
    from fedapps.flite import flite_config

    flite = flite_config(cfg, measure=False)
    if flite.latents is not None:
        return
    try:
        layers, error = _flite_layers(to_yaml(cfg.model), json.dumps(flite.to_dict(), sort_keys=True, default=str))
    except (ModelError, OSError, ValueError):
        return  # a model this process cannot describe (a hub id offline): its clients will say
    norms = [size for kind, size in layers if kind == "norm"]
    weights = len(layers) - len(norms)
    taken = sum(min(flite.norm_latents, size) for size in norms)
    if weights and flite.latent_budget - taken < weights:
        need = taken + weights
        fit = max(0, (flite.latent_budget - weights) // max(1, len(norms)))
        raise ConfigError(
            f"FLITE's algorithm.flite.latent_budget={flite.latent_budget} is too small for model "
            f"'{cfg.model.name}': its {len(norms)} norm layers take {taken} latents "
            f"(algorithm.flite.norm_latents={flite.norm_latents} each) and its {weights} weight layers need at "
            f"least one each; set algorithm.flite.latent_budget >= {need}"
            + (f", or algorithm.flite.norm_latents <= {fit}" if fit >= 1 else "")
            + ", or algorithm.flite.include_norms=false")
    if error:
        raise ConfigError(f"invalid algorithm.flite for model '{cfg.model.name}': {error}")


def _check_reply(algorithm) -> None:
    """FLITE's ``algorithm.reply``: full or compact."""
    from strategies.flite import REPLY_FORMS

    if "reply" in algorithm and algorithm.reply not in REPLY_FORMS:
        raise ConfigError(f"algorithm.reply must be one of {list(REPLY_FORMS)}, got {algorithm.reply!r}")


# why secure aggregation and differential privacy cannot carry a method's updates (both work on
# dense updates of one layout)
DENSE_ONLY = {
    "smartfed": "SmartFed's clients send their own active experts (sparse, different per client); a masked "
                "dense sum over every expert is not built",
    "topk": "top-k updates have each client's own support: masked values cannot be summed coordinate-wise",
    "powersgd": "PowerSGD factors are per client: their sum is not the sum of the updates",
}


def _check_secure(cfg: DictConfig) -> None:
    """``secure_aggregation`` builds (strategies.secure_round.SecureSettings) and suits the run."""
    from fedapps.secure import settings_of
    from strategies.secagg import SecAggError

    block = cfg.get("secure_aggregation")
    if not block:
        return
    if not isinstance(block.get("enabled"), bool):
        raise ConfigError(f"secure_aggregation.enabled must be true or false, got {block.get('enabled')!r}")
    try:
        settings = settings_of(cfg)
    except (SecAggError, TypeError, ValueError) as err:
        raise ConfigError(f"secure_aggregation: {err}") from None
    if settings is None:
        return
    _dense_mean_only(cfg, "secure_aggregation", "hides every client's update")
    threshold = settings.threshold
    clients = cfg.num_clients or cfg.task.get("default_clients")
    if threshold is not None and clients and not (2 <= threshold <= int(clients) and 2 * threshold > int(clients)):
        raise ConfigError(f"secure_aggregation.threshold must be a majority of the run's {clients} clients "
                          f"({max(2, int(clients) // 2 + 1)}..{clients}), got {threshold}")
    if clients is not None and int(clients) < 2:
        raise ConfigError("secure_aggregation needs at least 2 clients (the sum of one is its update)")


def _check_privacy(cfg: DictConfig) -> None:
    """``privacy`` builds (strategies.privacy.Privacy: the noise calibrated) and suits the run."""
    from fedapps.privacy import settings_of
    from strategies.privacy import PrivacyError

    try:
        settings = settings_of(cfg)
    except PrivacyError as err:
        raise ConfigError(str(err)) from None
    if settings is None:
        return
    _dense_mean_only(cfg, "privacy", "calibrates its noise to the mean of clipped updates")


def _dense_mean_only(cfg: DictConfig, what: str, why: str) -> None:
    """Secure aggregation and differential privacy take dense updates and the mean aggregator."""
    if cfg.algorithm.get("reply") == "compact":
        raise ConfigError(f"{what} cannot carry FLITE's compact reply (z's bytes alone, no room for masks or "
                          "noise bookkeeping): use algorithm.reply=full")
    for key in (str(cfg.algorithm.name), str(cfg.algorithm.get("payload", "fp32"))):
        if key in DENSE_ONLY:
            raise ConfigError(f"{what} cannot carry algorithm '{cfg.algorithm.name}' with payload "
                              f"'{cfg.algorithm.get('payload')}': {DENSE_ONLY[key]}")
    if cfg.robust.aggregator != "mean":
        raise ConfigError(f"{what} {why}; robust '{cfg.robust.aggregator}' does not fit (use robust=default or "
                          "robust=off)")


def _check_simulation(sim) -> None:
    cpus, gpus = sim.get("client_cpus", 1), sim.get("client_gpus", "auto")
    try:
        ok = float(cpus) > 0 and (gpus == "auto" or float(gpus) >= 0)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"simulation.client_cpus must be a number > 0 and simulation.client_gpus 'auto' or a "
                          f"number >= 0, got {cpus!r} / {gpus!r}")


def _apply_channel(cfg: DictConfig) -> None:
    """The ``channel`` group sets the algorithm's wire settings, or says why the method cannot carry it."""
    from fedapps.channel import ChannelError, apply

    try:
        apply(cfg)
    except ChannelError as err:
        raise ConfigError(str(err)) from None


def _check_uplink(algorithm) -> None:
    """``algorithm.payload`` / ``downlink`` / ``uplink`` / ``compression`` make formats the strategy accepts."""
    from strategies.compress import UPDATE_FORMATS, check_format

    from strategies.codec import FORMATS

    fmt = str(algorithm.get("payload", "fp32"))
    if fmt not in UPDATE_FORMATS:
        raise ConfigError(f"algorithm.payload '{fmt}' is not a payload format; valid: {', '.join(UPDATE_FORMATS)}")
    if "downlink" in algorithm and str(algorithm.downlink) not in FORMATS:
        raise ConfigError(f"algorithm.downlink '{algorithm.downlink}' is not a downlink format; valid: "
                          f"{', '.join(FORMATS)}")
    if fmt in ("topk", "powersgd"):
        if fmt not in (algorithm.get("channels") or []) and algorithm.name not in ("topk-ef", "powersgd") \
                or str(algorithm.get("uplink", "absolute")) != "delta":
            raise ConfigError(f"algorithm.payload={fmt} compresses updates: use channel={fmt} with a method that "
                              f"carries it (algorithm '{algorithm.name}' carries: "
                              f"{', '.join(map(str, algorithm.get('channels') or [])) or 'its own format only'})")
        comp = algorithm.get("compression") or {}
        try:
            check_format(fmt, comp.get("topk_fraction"), comp.get("powersgd_rank"))
        except ValueError as err:
            raise ConfigError(f"algorithm.compression: {err}") from None


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def from_yaml(text: str) -> DictConfig:
    cfg = OmegaConf.create(text)
    OmegaConf.set_struct(cfg, True)
    return cfg
