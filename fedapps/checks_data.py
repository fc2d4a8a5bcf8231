"""The data and model checks of a composed run configuration (``fedapps.checks.validate`` calls them):
the base model, the task's splits and settings, the partition, a local checkpoint's path (its own
name becomes ``model.name``). Imports no torch (a local-data task's path check reads
``clients.tasks.local``, which does).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from fedapps.method import ConfigError


def check_base(cfg: DictConfig) -> None:
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


def check_eval_split(task) -> None:
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


def check_passkey_task(cfg: DictConfig) -> None:
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


def check_text_task(cfg: DictConfig) -> None:
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


def check_partition(partition) -> None:
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


def check_model_path(model) -> None:
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


def label_model(model) -> None:
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
