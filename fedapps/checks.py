"""Validation of a composed run configuration (``fedapps.config.finalize`` runs :func:`validate`).

Generic checks only: each group's values, cross-group consistency, the channel, robustness, the
server optimiser, secure aggregation and differential privacy. A method's own settings are checked
by its record's ``check`` (``fedapps.registry.get(name).check``, in the method's module), and what
the generic checks need to know of a method is read from its record (``strategy``,
``own_format``, ``latent_downlink``): nothing here names a method. Imports no torch (a local-data
task's path check reads ``clients.tasks.local``, which does).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedapps.method import ConfigError
from strategies.uplink import uplink_of


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


def _check_sampling(cfg: DictConfig) -> None:
    """``strategy.fraction_train`` in (0, 1], ``fraction_evaluate`` in [0, 1] (0: no federated evaluation);
    ``strategy.min_clients`` null or 1..num_clients."""
    for key, low in (("fraction_train", "("), ("fraction_evaluate", "[")):  # evaluation 0: none (Flower's rule)
        value = cfg.strategy.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1 or
                                                                                   (low == "[" and value == 0)):
            raise ConfigError(f"strategy.{key} must be a number in {low}0, 1] (the share of clients a round samples), "
                              f"got {value!r}")
    least, clients = cfg.strategy.get("min_clients"), cfg.get("num_clients") or cfg.task.get("default_clients")
    if least is None:
        return
    if isinstance(least, bool) or not isinstance(least, int) or least < 1 or (clients and least > int(clients)):
        raise ConfigError(f"strategy.min_clients must be null or an integer in 1..num_clients ({clients}), "
                          f"got {least!r}")


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


def validate(cfg: DictConfig, ready: bool = True) -> None:
    """Every check of a composed config (writable), in order; raises ConfigError naming the fix. Two steps
    also derive settings: the channel's wire settings (``fedapps.channel.apply``) and a checkpoint's own
    name as ``model.name`` (:func:`_label_model`). The method's own settings are its record's ``check``;
    with ``ready``, last, what a run of it needs on this machine (its record's ``ready``: SmartFed's pool)."""
    method = _method(cfg)
    _check_numbers(cfg)
    _check_sampling(cfg)
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
    if cfg.algorithm.get("eval_local", False) not in (True, False, "last"):
        raise ConfigError(f"algorithm.eval_local must be true, false or last (the last round only), got "
                          f"{cfg.algorithm.eval_local!r}")
    _check_eval_split(cfg.task)
    _check_text_task(cfg)
    _check_passkey_task(cfg)
    allowed = cfg.algorithm.get("models")
    if allowed and kind not in allowed:
        raise ConfigError(f"algorithm '{cfg.algorithm.name}' runs on {' or '.join(map(str, allowed))} models, but "
                          f"model '{cfg.model.name}' is {kind}")
    if cfg.algorithm.trainable == "lora" and kind not in ("causal_lm", "vision"):
        raise ConfigError(f"algorithm '{cfg.algorithm.name}' adapts a causal LM or a vision backbone; "
                          f"use fedavg-full for '{cfg.model.name}'")
    _apply_channel(cfg)
    _check_uplink(cfg.algorithm, method)
    _check_learning_rates(cfg.algorithm)
    if cfg.get("tracking") not in (None, "tensorboard"):
        raise ConfigError(f"tracking must be null or tensorboard, got {cfg.get('tracking')!r}")
    _check_partition(cfg.partition)
    _check_model_path(cfg.model)
    _label_model(cfg.model)
    _check_robust(cfg)
    _check_server_optimizer(cfg)
    if method.check is not None:
        method.check(cfg)
    _check_secure(cfg, method)
    _check_privacy(cfg, method)
    _check_simulation(cfg.get("simulation") or {})
    for key in ("train.bf16", "train.grad_checkpointing"):
        value = OmegaConf.select(cfg, key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    if ready and method.ready is not None:  # after every setting: a wrong setting is named first
        method.ready(cfg)


def _method(cfg: DictConfig):
    """The registered record of ``algorithm.name`` (fedapps.registry: imports no torch)."""
    from fedapps import registry

    try:
        return registry.get(str(cfg.algorithm.name))
    except KeyError as err:
        raise ConfigError(f"algorithm.name: {err.args[0]}") from None


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


def _check_eval_split(task) -> None:
    """``task.eval_split``: ``test`` scores the test items; ``val`` a validation split carved from the
    clients' training data (``clients.partition.held_out_split``), for tuning (docs/benchmarks.md). A task
    without the key (mmlu, niah: their own fixed splits) refuses it as an unknown key."""
    from clients.partition import EVAL_SPLITS  # numpy only: composing still imports no torch

    which = task.get("eval_split", "test")
    if which not in EVAL_SPLITS:
        raise ConfigError(f"task.eval_split must be {' or '.join(EVAL_SPLITS)}, got {which!r}")
    fraction = task.get("val_fraction")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction < 1):
        raise ConfigError(f"task.val_fraction must be null (= task.test_fraction) or a number in (0, 1), "
                          f"got {fraction!r}")


def _check_passkey_task(cfg: DictConfig) -> None:
    """``kind: passkey`` (``task=passkey``): its settings, FedNL's window against its lengths and the key's
    distance (clients.tasks.passkey.task_settings), when the config is composed."""
    if cfg.task.kind != "passkey":
        return
    from clients.tasks.base import TaskError
    from clients.tasks.passkey import task_settings

    if cfg.model.kind != "causal_lm":
        raise ConfigError(f"task 'passkey' needs a causal LM, but model '{cfg.model.name}' is {cfg.model.kind}")
    try:
        task_settings(cfg)
    except TaskError as err:
        raise ConfigError(str(err)) from None


def _check_text_task(cfg: DictConfig) -> None:
    """``kind: text`` (``task=text``, ``task=instructions``: clients.tasks.local): the settings, and that
    ``task.path``'s data are readable and enough for every client (``clients.tasks.local.check_data``),
    before any client starts."""
    task = cfg.task
    if task.kind != "text":
        return
    from clients.tasks.base import TaskError
    from clients.tasks.local import FORMATS, METRICS, SAMPLE_BY, TEMPLATE_KEYS, check_data, read_template_file

    if task.get("template_file"):  # its templates replace the keys (the config sent to clients carries them)
        try:
            templates = read_template_file(task.template_file)
        except TaskError as err:
            raise ConfigError(str(err)) from None
        for key in TEMPLATE_KEYS:
            task[key] = templates.get(key)
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
        check_data(cfg)  # syntax, encoding, fields, every client's share: refused here, not by a client later
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
    the online user), ``model.gguf`` a readable GGUF file (``clients.assets.check_gguf``: its header and
    tensor infos, as ``postcard convert`` reads them; not converted), not both; ``model=hf`` needs one of
    them. Checked here, not on every client after the run started."""
    if model.get("kind") != "causal_lm":  # a vision model's path is a .pt file, checked on load
        return
    path, gguf = model.get("path"), model.get("gguf")
    if path and gguf:
        raise ConfigError("model.path and model.gguf both name the weights; give one (model.gguf=FILE is converted "
                          "once; `postcard convert --gguf FILE --out DIR` then model.path=DIR does it yourself)")
    if gguf:
        if not Path(str(gguf)).expanduser().is_file():
            raise ConfigError(f"model.gguf '{gguf}' is not a file; give a .gguf file (absolute path)")
        from clients.assets import ConversionError, check_gguf  # the gguf reader: numpy, no torch

        try:  # read as `postcard convert` reads it first: a truncated file here, not on every client
            check_gguf(gguf)
        except ConversionError as err:
            raise ConfigError(str(err)) from None
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
    """The ``robust`` group builds (strategies.robust.Robustness)."""
    from strategies.robust import Robustness

    try:
        Robustness.from_mapping(OmegaConf.to_container(cfg.robust, resolve=True))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_server_optimizer(cfg: DictConfig) -> None:
    """``strategy.server_optimizer`` builds (strategies.server_opt.ServerOptimizer)."""
    from strategies.server_opt import ServerOptimizer

    block = cfg.strategy.get("server_optimizer")
    try:
        ServerOptimizer.from_mapping(None if block is None else OmegaConf.to_container(block, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None


# why secure aggregation and differential privacy cannot carry a payload format (both work on dense
# updates of one layout)
DENSE_ONLY = {
    "topk": "top-k updates have each client's own support: masked values cannot be summed coordinate-wise",
    "powersgd": "PowerSGD factors are per client: their sum is not the sum of the updates",
}


def _check_secure(cfg: DictConfig, method) -> None:
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
    _dense_mean_only(cfg, method, "secure_aggregation", "hides every client's update")
    threshold = settings.threshold
    clients = cfg.num_clients or cfg.task.get("default_clients")
    if threshold is not None and clients and not (2 <= threshold <= int(clients) and 2 * threshold > int(clients)):
        raise ConfigError(f"secure_aggregation.threshold must be a majority of the run's {clients} clients "
                          f"({max(2, int(clients) // 2 + 1)}..{clients}), got {threshold}")
    if clients is not None and int(clients) < 2:
        raise ConfigError("secure_aggregation needs at least 2 clients (the sum of one is its update)")


def _check_privacy(cfg: DictConfig, method) -> None:
    """``privacy`` builds (strategies.privacy.Privacy: the noise calibrated) and suits the run."""
    from fedapps.privacy import settings_of
    from strategies.privacy import PrivacyError

    try:
        settings = settings_of(cfg)
    except PrivacyError as err:
        raise ConfigError(str(err)) from None
    if settings is None:
        return
    _dense_mean_only(cfg, method, "privacy", "calibrates its noise to the mean of clipped updates")


def _dense_mean_only(cfg: DictConfig, method, what: str, why: str) -> None:
    """Secure aggregation and differential privacy take dense updates, the mean aggregator, and a linear
    combiner (``Method.strategy.linear``: the strategy does not combine by a rule of its own)."""
    if method.strategy is not None and not method.strategy.linear:
        raise ConfigError(f"{what} cannot carry algorithm '{method.name}': its strategy combines the clients' "
                          f"updates by a rule of its own (it overrides the combine hook), but {what} {why} and "
                          "works on the weighted mean of dense updates of one layout")
    if cfg.algorithm.get("reply") == "compact":
        raise ConfigError(f"{what} cannot carry FLITE's compact reply (z's bytes alone, no room for masks or "
                          "noise bookkeeping): use algorithm.reply=full")
    payload = str(cfg.algorithm.get("payload", "fp32"))
    if payload in DENSE_ONLY:
        raise ConfigError(f"{what} cannot carry algorithm '{cfg.algorithm.name}' with payload "
                          f"'{cfg.algorithm.get('payload')}': {DENSE_ONLY[payload]}")
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
    from fedapps import registry
    from fedapps.channel import ChannelError, apply

    try:
        apply(cfg, [name for name, method in registry.METHODS.items() if method.latent_downlink])
    except ChannelError as err:
        raise ConfigError(str(err)) from None


def _check_uplink(algorithm, method) -> None:
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
        if fmt not in (algorithm.get("channels") or []) and method.own_format != fmt \
                or uplink_of(algorithm) != "delta":
            raise ConfigError(f"algorithm.payload={fmt} compresses updates: use channel={fmt} with a method that "
                              f"carries it (algorithm '{algorithm.name}' carries: "
                              f"{', '.join(map(str, algorithm.get('channels') or [])) or 'its own format only'})")
        comp = algorithm.get("compression") or {}
        try:
            check_format(fmt, comp.get("topk_fraction"), comp.get("powersgd_rank"))
        except ValueError as err:
            raise ConfigError(f"algorithm.compression: {err}") from None
