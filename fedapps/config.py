"""Compose the run configuration with Hydra from ``conf/`` (no ``@hydra.main`` inside apps).

One function, :func:`compose`, is used by the ServerApp (from Flower's ``run_config``),
by the ``postcard`` CLI and by tests, so a run means the same thing however it starts.
:func:`finalize` then validates the result (``fedapps.checks``; a method's own settings by its
record's ``check``). Composing and validating import no torch.
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

from fedapps.method import ConfigError  # noqa: F401 - re-exported: what compose and the checks raise
from fedapps.resolved import from_yaml, to_yaml  # noqa: F401 - re-exported

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algorithm", "task", "model", "partition", "preset", "robust", "base", "channel")
# run_config keys (pyproject [tool.flwr.app.config]) that are not Hydra groups
RUN_CONFIG_KEYS = (*GROUPS, "overrides", "output-dir", "config-dir")


def choices(group: str, conf_path: Sequence[str | Path] = ()) -> list[str]:
    """The options of a config group, i.e. the yaml files in ``conf/<group>/`` (and in ``conf_path``'s)."""
    return sorted({p.stem for folder in (CONF_DIR, *map(Path, conf_path)) for p in (folder / group).glob("*.yaml")})


def _searched(items: list[str], conf_path: tuple[str, ...]) -> list[str]:
    """Hydra overrides with ``conf_path`` on its search path (after ``conf/``)."""
    if not conf_path:
        return items
    return [f"hydra.searchpath=[{','.join(Path(p).resolve().as_uri() for p in conf_path)}]", *items]


def _check_choice(group: str, value: str, conf_path: Sequence[str | Path] = ()) -> None:
    valid = choices(group, conf_path)
    if value not in valid:
        raise ConfigError(f"unknown {group} '{value}'; valid choices: {', '.join(valid)}")


def compose(overrides: Sequence[str] | str = (), *, conf_path: Sequence[str | Path] = (), ready: bool = False,
            **groups: str | None) -> DictConfig:
    """Compose ``conf/config.yaml`` with group choices and Hydra overrides.

    ``compose(["train.lr=1e-4"], algorithm="fedprox", task="mmlu")``; empty or ``None``
    group values keep the defaults. ``conf_path``: further config folders, searched after
    ``conf/`` (Hydra's search path), e.g. one holding ``algorithm/<name>.yaml`` of a method kept
    outside the checkout. Raises :class:`ConfigError` for an unknown group choice or key,
    naming what is valid. ``ready``: also what a run of it needs on this machine (a method's
    ``ready`` check: SmartFed's pool), as :func:`finalize` checks before a run is submitted; off, so
    that a config composes to be looked at (``postcard --cfg job``) before its pool is built.
    """
    conf_path = tuple(str(p) for p in conf_path)
    if isinstance(overrides, str):
        overrides = shlex.split(overrides)
    items: list[str] = []
    for group, value in groups.items():
        if group not in GROUPS:
            raise ConfigError(f"unknown config group '{group}'; valid groups: {', '.join(GROUPS)}")
        if value:
            _check_choice(group, str(value), conf_path)
            items.append(f"{group}={value}")
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in GROUPS and "=" in item:
            _check_choice(key, item.split("=", 1)[1], conf_path)
    group_items = items + [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS]
    _check_keys(group_items, overrides, conf_path)
    check_preset(group_items, conf_path)
    items.extend(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="postcard"):
            cfg = hydra_compose(config_name="config", overrides=_searched(items, conf_path))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err)) from None
    return finalize(cfg, ready=ready)


def check_overrides(overrides: Sequence[str], conf_path: Sequence[str | Path] = ()) -> None:
    """Group choices and keys of command-line overrides, before Hydra sees them (a sweep's
    ``key=a,b`` is checked per choice); ConfigError names the fix. ``conf_path``: as :func:`compose`'s."""
    conf_path = tuple(str(p) for p in conf_path)
    groups = []
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if key in GROUPS and value:
            for choice in value.split(","):
                _check_choice(key, choice, conf_path)
            groups.append(f"{key}={value.split(',')[0]}")
    _check_keys(groups, overrides, conf_path)
    check_preset(groups, conf_path)


def _preset_file(name: str, conf_path: Sequence[str | Path] = ()) -> Path | None:
    for folder in (CONF_DIR, *map(Path, conf_path)):
        path = folder / "preset" / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def check_preset(group_items: Sequence[str], conf_path: Sequence[str | Path] = ()) -> None:
    """Every key a preset sets exists in the config it composes to, so a misspelled key in a user's
    preset (Hydra merges a config file's new keys without complaint) is refused, naming the file.
    The known keys come from the preset as written: its own ``override /group: choice`` lines over the
    defaults (a caller's explicit choice still wins in the run, as in Hydra: ``preset=fednl-niah-paper
    algorithm=fedala`` keeps the preset's FedNL-only keys, unused)."""
    choice = dict(item.lstrip("+~").split("=", 1) for item in group_items if "=" in item)
    name = choice.get("preset", "none")
    path = _preset_file(name, conf_path) if name not in ("", "none") else None
    if path is None:
        return
    try:
        body = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OmegaConfBaseException, OSError, ValueError) as err:
        raise ConfigError(f"preset '{name}' ({path}) does not parse: {str(err).splitlines()[0]}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"preset '{name}' ({path}) must be a mapping of keys, got {type(body).__name__}")
    groups = {}
    for entry in body.pop("defaults", None) or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                group = str(key).replace("override", "").strip().lstrip("/")
                if group in GROUPS and group != "preset":
                    groups[group] = str(value)
    known = _known_keys(tuple(sorted(f"{k}={v}" for k, v in groups.items())), tuple(map(str, conf_path)))
    inner = {k.rsplit(".", 1)[0] for k in known if "." in k}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = prefix + str(key)
            if dotted.startswith("hydra"):
                continue
            if dotted not in known:
                close = difflib.get_close_matches(dotted, sorted(known), n=2, cutoff=0.6)
                hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else \
                    " (`postcard --cfg job` prints every key)"
                raise ConfigError(f"preset '{name}' ({path}) sets unknown config key '{dotted}'{hint}")
            if isinstance(value, dict) and dotted in inner:
                walk(value, dotted + ".")

    walk(body, "")


@functools.lru_cache(maxsize=32)
def _known_keys(group_items: tuple[str, ...], conf_path: tuple[str, ...] = ()) -> frozenset[str]:
    """Every dotted key (inner nodes too) of the config these group choices compose to."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="postcard"):
        base = OmegaConf.to_container(hydra_compose(config_name="config",
                                                    overrides=_searched(list(group_items), conf_path)))
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            keys.add(prefix + str(key))
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")

    walk(base, "")
    return frozenset(keys)


def _check_keys(group_items: list[str], overrides: Sequence[str], conf_path: tuple[str, ...] = ()) -> None:
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
            known = _known_keys(tuple(sorted(group_items)), conf_path)
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


def compose_from_run_config(run_config: Mapping[str, object], ready: bool = False) -> DictConfig:
    """Flower ``context.run_config`` (pyproject keys + ``--run-config``) -> composed config; ``ready`` as
    :func:`compose`'s (``postcard.app_run`` checks a run's needs before it submits)."""
    unknown = sorted(set(run_config) - set(RUN_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"unknown run-config keys {unknown}; valid keys: {', '.join(RUN_CONFIG_KEYS)}")
    overrides = shlex.split(str(run_config.get("overrides", "") or ""))
    output_dir = str(run_config.get("output-dir", "") or "")
    if output_dir:
        overrides.append(f"output_dir={output_dir}")
    config_dir = str(run_config.get("config-dir", "") or "")
    if config_dir and not Path(config_dir).expanduser().is_dir():
        raise ConfigError(f"config-dir '{config_dir}' is not a folder (on a deployment, the server machine needs it "
                          "at the same path)")
    conf_path = [str(Path(config_dir).expanduser())] if config_dir else []
    return compose(overrides, conf_path=conf_path, ready=ready,
                   **{g: str(run_config.get(g, "") or "") for g in GROUPS})


def finalize(cfg: DictConfig, ready: bool = True) -> DictConfig:
    """Check a composed config (``fedapps.checks.validate``: cross-group consistency, the method's own
    check) and fill what it derives (the channel's wire settings, a checkpoint's model name); then freeze it.
    ``ready`` (the default: ``postcard`` and ``postcard.app_run`` call this before they submit a run): also
    what the run needs on this machine, its method's ``ready`` check (SmartFed: its knowledge pool)."""
    from fedapps.checks import validate

    OmegaConf.set_struct(cfg, False)
    validate(cfg, ready=ready)
    OmegaConf.set_struct(cfg, True)
    return cfg
