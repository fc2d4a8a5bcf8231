"""Validation of a composed run configuration (``fedapps.config.finalize`` runs :func:`validate`).

Generic checks only: each group's values, cross-group consistency, the channel, robustness, the
server optimiser, secure aggregation and differential privacy. A method's own settings are checked
by its record's ``check`` (``fedapps.registry.get(name).check``, in the method's module), and what
the generic checks need to know of a method is read from its record (``strategy``,
``own_format``, ``latent_downlink``): nothing here names a method. Imports no torch (a local-data
task's path check reads ``clients.tasks.local``, which does).
"""

from __future__ import annotations


from omegaconf import DictConfig, OmegaConf

from fedapps.checks_data import (check_base, check_eval_split, check_model_path, check_partition,
                                 check_passkey_task, check_text_task, label_model)
from fedapps.method import ConfigError
from fedapps.resolved import client_count
from strategies.release import Sampling
from strategies.uplink import Wire, uplink_of


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
            continue  # resolved at run start: the task's default_clients (fedapps.resolved.client_count)
        try:
            number = kind(value)
            if isinstance(value, bool) or (kind is int and float(value) != number):
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
        if number < low or (kind is float and number == low == 0.0):
            raise ConfigError(f"{key} must be {'>' if kind is float else '>='} {low}, got {value!r}")


def _check_sampling(cfg: DictConfig) -> None:
    """The ``strategy`` group's sampling builds (:class:`strategies.release.Sampling`: the strategy builds the same)."""
    try:
        Sampling.from_mapping(cfg.strategy, client_count(cfg))
    except ValueError as err:
        raise ConfigError(str(err)) from None


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
    name as ``model.name`` (:func:`label_model`). The method's own settings are its record's ``check``;
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
    check_base(cfg)
    if cfg.algorithm.get("eval_local", False) not in (True, False, "last"):
        raise ConfigError(f"algorithm.eval_local must be true, false or last (the last round only), got "
                          f"{cfg.algorithm.eval_local!r}")
    check_eval_split(cfg.task)
    check_text_task(cfg)
    check_passkey_task(cfg)
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
    check_partition(cfg.partition)
    check_model_path(cfg.model)
    label_model(cfg.model)
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
    payload = Wire.of(cfg.algorithm).format
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
    try:  # what the strategy and the clients build (one default per key), as they build it
        Wire.of(algorithm)
    except ValueError as err:
        raise ConfigError(f"algorithm: {err}") from None
