"""``postcard pool {build,add,list}``: SmartFed's LoRA knowledge pool from the command line.

    postcard pool build [--sources A,B] [--pool DIR] [--spec NAME|FILE] [OVERRIDE ...]
    postcard pool add RUN_DIR [--pool DIR] [--name NAME] [--task TEXT]
    postcard pool list [--pool DIR] [--json]

``build`` runs one short federated LoRA fine-tuning (a Flower simulation, ``fedavg-lora``)
per *source* of a spec (``conf/pool/default.yaml``: embedded tasks such as Shakespeare
play groups and MMLU super-categories) and adds each run's final adapter with its
provenance; sources already in the pool are skipped, so an interrupted build resumes.
OVERRIDEs are Hydra overrides applied to every source run (``model=tiny-llama``,
``rounds=1``, ``train.local_steps=4``, ``seed=7`` ...).

``add`` adds the adapter a finished LoRA run saved (``RUN_DIR/adapter``; fedavg-lora,
fedprox and ffa-lora runs save one), with provenance read from the run's ``config.yaml``
and ``summary.json``. An adapter for another backbone is refused.

The pool of a model lives in ``$POSTCARD_CACHE/pool/<model name>`` unless ``--pool`` says
otherwise (the name of ``model=hf model.path=DIR`` is the checkpoint's own, e.g. the folder's); a SmartFed run finds it there (or at ``algorithm.pool``). Exit status 2 and a
message on stderr for anything that cannot be done.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from clients.pool import backbone_descriptor, default_pool_dir

SPEC_DIR = Path(__file__).resolve().parent.parent / "conf" / "pool"


class PoolCommandError(RuntimeError):
    """What `postcard pool` cannot do; the message says why."""


# ---------------------------------------------------------------------------- helpers
def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def task_data(cfg) -> dict:
    """The data a run trained on, for provenance (plays, MMLU categories, partitioning)."""
    task = cfg.task
    data = {"task": str(task.name), "partition": str(cfg.partition.name), "num_clients": int(cfg.num_clients)}
    if "plays" in task:
        data["plays"] = _plain(task.plays)
    if "categories" in task:
        data["categories"] = sorted(_plain(task.categories))
    return data


def _provenance(cfg, run_dir: Path, summary: dict | None, **extra) -> dict:
    summary = summary or {}
    record = {
        "source_run": str(run_dir),
        "task": str(cfg.task.name),
        "data": task_data(cfg),
        "algorithm": str(cfg.algorithm.name),
        "backbone": backbone_descriptor(cfg),
        "rounds": int(cfg.rounds),
        "local_steps": int(cfg.train.local_steps),
        "metric": summary.get("metric", str(cfg.task.metric)),
        "initial_metric": summary.get("initial_metric"),
        "final_metric": summary.get("final_metric"),
    }
    record.update({k: v for k, v in extra.items() if v is not None})
    return record


def _open_or_create(path: Path, cfg):
    """The pool at ``path``; created for ``cfg``'s backbone when absent (needs the model)."""
    from clients.models.llm import load_causal_lm
    from clients.pool import POOL_FILE, Pool, backbone_fingerprint

    model, _ = load_causal_lm(cfg.model, seed=int(cfg.seed))
    if not (path / POOL_FILE).is_file():
        pool = Pool(path, backbone=model)
        print(f"created pool {path} for {cfg.model.name} (backbone {pool.fingerprint})")
        return pool
    pool = Pool(path)
    fingerprint = backbone_fingerprint(model)
    if fingerprint != pool.fingerprint:
        raise PoolCommandError(
            f"the pool {path} is for backbone {pool.fingerprint} ({pool.signature['model_type']}, hidden "
            f"{pool.signature['hidden_size']}, {pool.signature['num_hidden_layers']} layers); model "
            f"'{cfg.model.name}' is {fingerprint}: an adapter for another backbone cannot join it; give this "
            f"model a pool of its own with --pool DIR (then algorithm.pool=DIR in its SmartFed runs)"
        )
    ours = backbone_descriptor(cfg)
    for name in pool.names():
        theirs = pool.provenance(name).get("backbone")
        if theirs and theirs != ours and cfg.model.get("random_init"):
            raise PoolCommandError(
                f"the pool {path} holds '{name}', trained on {theirs}; this run's backbone is {ours}: "
                "random-init models of different seeds have the same shapes but different weights"
            )
    return pool


def load_spec(spec: str | Path) -> dict:
    """A pool-sources spec: a name in conf/pool/ or a YAML file."""
    path = Path(spec)
    if not path.suffix:
        path = SPEC_DIR / f"{spec}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))
        raise PoolCommandError(f"no pool spec '{spec}' (a YAML file, or one of {known} in {SPEC_DIR})")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict) or not isinstance(data.get("sources"), dict) or not data["sources"]:
        raise PoolCommandError(f"pool spec {path} has no `sources` mapping")
    for name, source in data["sources"].items():
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", str(name)):
            raise PoolCommandError(f"pool spec {path}: source name {name!r} must be a plain folder name")
        if not isinstance(source, dict) or "task" not in source:
            raise PoolCommandError(f"pool spec {path}: source '{name}' needs a `task`")
    return data


def compose_source(spec: dict, name: str, overrides: list[str]):
    """The run configuration of one pool source (spec overrides, source's, then the command's)."""
    from fedapps.config import compose

    if name not in spec["sources"]:
        raise PoolCommandError(f"unknown pool source '{name}'; the spec has {sorted(spec['sources'])}")
    source = spec["sources"][name]
    items = [*spec.get("overrides", []), *source.get("overrides", []), *overrides]
    if not any(item.startswith("run_name=") for item in overrides):
        items.append(f"run_name=pool-{name}")
    cfg = compose(items, algorithm=spec.get("algorithm"), task=str(source["task"]))  # none: the config's default
    if cfg.algorithm.get("trainable") != "lora":
        raise PoolCommandError(f"pool source '{name}': algorithm '{cfg.algorithm.name}' trains no LoRA adapter")
    return cfg


def _not_the_run_simulation_banner(record) -> bool:
    """A filter of Flower's logger: False for its "DEPRECATED FEATURE" banner on ``run_simulation``."""
    return not (str(record.msg).lstrip().startswith("DEPRECATED FEATURE") and "`run_simulation`" in record.getMessage())


class _Uncoloured:
    """A text stream that drops ANSI colour and cursor codes from what is written to it."""

    def __init__(self, stream) -> None:
        from postcard.app_run import ANSI

        self._stream, self._ansi = stream, ANSI

    def write(self, text: str) -> int:
        return self._stream.write(self._ansi.sub("", text))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def simulation_output():
    """What ``pool build`` shows of its in-process simulations (``fedapps.simulation.simulate``, which
    calls Flower's ``run_simulation``; runs users start go through ``flwr run``): never Flower's banner
    that ``run_simulation`` is deprecated, and, when stdout or stderr is not a terminal (a log file,
    a pipe) or ``NO_COLOR`` is set, no ANSI colour codes — Flower's log levels uncoloured, and the
    lines Ray relays from the simulated clients stripped (as ``postcard.app_run`` relays `flwr run`'s)."""
    from flwr.common.logger import FLOWER_LOGGER, ConsoleHandler

    tty = all(hasattr(s, "isatty") and s.isatty() for s in (sys.stdout, sys.stderr))
    plain = not tty or bool(os.environ.get("NO_COLOR"))
    handlers = [h for h in FLOWER_LOGGER.handlers if isinstance(h, ConsoleHandler)]
    colored = [h.colored for h in handlers]
    streams = sys.stdout, sys.stderr
    FLOWER_LOGGER.addFilter(_not_the_run_simulation_banner)
    if plain:
        for handler in handlers:
            handler.colored = False
        sys.stdout, sys.stderr = _Uncoloured(sys.stdout), _Uncoloured(sys.stderr)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeFilter(_not_the_run_simulation_banner)
        if plain:
            sys.stdout, sys.stderr = streams
            for handler, was in zip(handlers, colored):
                handler.colored = was


# ---------------------------------------------------------------------------- commands
def build(
    sources: list[str] | None = None,
    overrides: list[str] = (),
    pool: str | Path | None = None,
    spec: str | Path = "default",
) -> list[str]:
    """Run each source's federated LoRA fine-tuning and add its adapter; returns the names added."""
    from clients.pool import PoolError
    from fedapps.simulation import simulate

    data = load_spec(spec)
    names = list(sources or data.get("default") or sorted(data["sources"]))
    configs = {name: compose_source(data, name, list(overrides)) for name in names}  # fail fast on bad input
    descriptors = {json.dumps(backbone_descriptor(cfg), sort_keys=True) for cfg in configs.values()}
    if len(descriptors) != 1:
        raise PoolCommandError(f"the sources would train on different backbones {sorted(descriptors)}; a pool has one")
    first = next(iter(configs.values()))
    path = Path(pool).expanduser().resolve() if pool else default_pool_dir(str(first.model.name))
    target = _open_or_create(path, first)
    added = []
    for name, cfg in configs.items():
        if name in target:
            print(f"'{name}' is already in {path}; skipped (remove {path / name} to rebuild it)")
            continue
        print(f"== pool source '{name}': {cfg.algorithm.name} on {cfg.task.name} "
              f"({data['sources'][name].get('description', '')}), {cfg.rounds} round(s)")
        with simulation_output():
            summary = simulate(cfg)
        run_dir = Path(summary["run_dir"])
        provenance = _provenance(cfg, run_dir, summary, source=name,
                                 description=data["sources"][name].get("description"))
        try:
            target.add(run_dir / "adapter", provenance, name=name)
        except PoolError as err:
            raise PoolCommandError(f"source '{name}' (run {run_dir}): {err}") from None
        print(f"added '{name}' to {path} (from {run_dir})")
        added.append(name)
    return added


def add(run_dir: str | Path, pool: str | Path | None = None, name: str | None = None, task: str | None = None) -> str:
    """Add a finished LoRA run's adapter (``RUN_DIR/adapter``); returns its name in the pool."""
    from fedapps.config import from_yaml

    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / "config.yaml").is_file():
        raise PoolCommandError(f"{run_dir} is not a Postcard run folder (no config.yaml)")
    cfg = from_yaml((run_dir / "config.yaml").read_text())
    if not (run_dir / "adapter").is_dir():
        raise PoolCommandError(
            f"{run_dir} has no adapter/ folder: only runs of a method that trains and saves a LoRA adapter "
            f"(a PEFT folder, adapter/) can join a pool, and this run is {cfg.algorithm.name}"
        )
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    name = name or re.sub(r"[^A-Za-z0-9._-]+", "-", f"{cfg.task.name}-{run_dir.name}").strip("-.")
    path = Path(pool).expanduser().resolve() if pool else default_pool_dir(str(cfg.model.name))
    target = _open_or_create(path, cfg)
    provenance = _provenance(cfg, run_dir, summary)
    if task:
        provenance["task"] = task
    return target.add(run_dir / "adapter", provenance, name=name)


def list_pool(pool: str | Path | None = None, as_json: bool = False) -> str:
    """A table (or JSON lines) of the pool's adapters; every default pool when none is given."""
    from clients.assets import cache_dir
    from clients.pool import POOL_FILE, Pool

    if pool:
        paths = [Path(pool).expanduser().resolve()]
        if not (paths[0] / POOL_FILE).is_file():
            raise PoolCommandError(f"{paths[0]} is not a knowledge pool (no {POOL_FILE}); create one with `postcard pool build`")
    else:
        paths = sorted(p.parent for p in (cache_dir() / "pool").glob(f"*/{POOL_FILE}"))
        if not paths:
            raise PoolCommandError(f"no knowledge pool under {cache_dir() / 'pool'}; create one with `postcard pool build`")
    lines = []
    for path in paths:
        p = Pool(path)
        records = p.list()
        if as_json:
            lines += [json.dumps(r, sort_keys=True) for r in records]
            continue
        lines.append(f"{path}  (backbone {p.fingerprint}, {len(records)} adapter(s), "
                     f"{sum(r['num_experts'] for r in records)} rank-1 experts)")
        lines.append("| name | task | data | rank | experts | metric (initial -> final) | source run | created |")
        lines.append("|---|---|---|---:|---:|---|---|---|")
        for r in records:
            data = r.get("data") or {}
            what = ", ".join(data.get("plays") or data.get("categories") or []) or "-"
            metric = (f"{r['metric']} {_num(r.get('initial_metric'))} -> {_num(r.get('final_metric'))}"
                      if r.get("metric") else "-")
            lines.append(f"| {r['name']} | {r['task']} | {what} | {r['rank']} | {r['num_experts']} | {metric} | "
                         f"{r['source_run']} | {r.get('created', '-')} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _num(value) -> str:
    return "-" if value is None else f"{float(value):.4g}"


# ---------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="postcard pool", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="fill the pool with short federated LoRA runs on embedded tasks")
    p_build.add_argument("overrides", nargs="*", help="Hydra overrides for every source run (model=..., rounds=...)")
    p_build.add_argument("--sources", default=None, help="comma-separated source names (default: the spec's `default`)")
    p_build.add_argument("--pool", default=None, help="pool folder (default: $POSTCARD_CACHE/pool/<model name>)")
    p_build.add_argument("--spec", default="default", help="sources spec: a name in conf/pool/ or a YAML file")
    p_build.add_argument("--list-sources", action="store_true", help="print the spec's sources and exit")
    p_add = sub.add_parser("add", help="add a finished LoRA run's adapter (RUN_DIR/adapter)")
    p_add.add_argument("run_dir")
    p_add.add_argument("--pool", default=None, help="pool folder (default: that of the run's model)")
    p_add.add_argument("--name", default=None, help="name in the pool (default: <task>-<run folder name>)")
    p_add.add_argument("--task", default=None, help="task label for the provenance (default: the run's task)")
    p_list = sub.add_parser("list", help="show the pool's adapters and their provenance")
    p_list.add_argument("--pool", default=None, help="pool folder (default: every pool in $POSTCARD_CACHE/pool)")
    p_list.add_argument("--json", action="store_true", help="one JSON provenance record per line")
    args = parser.parse_args(argv)

    from clients.pool import PoolError
    from fedapps.config import ConfigError

    try:
        if args.command == "build":
            if args.list_sources:
                data = load_spec(args.spec)
                for name, source in data["sources"].items():
                    mark = "*" if name in (data.get("default") or []) else " "
                    print(f"{mark} {name:24s} task={source['task']:12s} {source.get('description', '')}")
                return 0
            sources = [s for s in (args.sources or "").split(",") if s] or None
            added = build(sources, args.overrides, args.pool, args.spec)
            print(f"pool build done: {len(added)} adapter(s) added")
        elif args.command == "add":
            name = add(args.run_dir, args.pool, args.name, args.task)
            print(f"added '{name}'")
        else:
            print(list_pool(args.pool, args.json))
    except (PoolCommandError, PoolError, ConfigError, KeyError) as err:
        print(f"postcard pool: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
