"""Server checkpoints: the strategy's state after every round, and resuming from it.

A run folder holds ``checkpoint.npz`` once its round 0 is done: the strategy's arrays
(the global state), the last completed round, the round history and the run's identity
(algorithm, task, model, partition, seed, clients). It is replaced atomically after
every round (written to a temporary file in the same folder, synced, then renamed), so a
crash at any moment leaves either the previous checkpoint or the new one.

A run resumes when it is started again with ``resume`` set:

* ``resume=/abs/path/to/run_folder`` continues that folder from its checkpoint;
* ``resume=auto`` (or ``true``) with a fixed ``run_name`` continues
  ``<output_dir>/<run_name>`` if it holds a checkpoint, and starts it fresh otherwise —
  the same command can be repeated after any crash.

The resumed run must be the same experiment (the identity keys must match); ``rounds``
may grow, and settings such as ``train.lr`` or ``strategy.*`` may change.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from logging import INFO
from pathlib import Path

import numpy as np
from flwr.common.logger import log
from omegaconf import OmegaConf

from fedapps.filemodes import file_mode
from fedapps.outputs import RunDir, output_root

CHECKPOINT = "checkpoint.npz"
FORMAT = 1
_META = "__meta__"
_PREFIX = "state/"
# what must not change between a run and its resumption
IDENTITY_KEYS = ("algorithm.name", "task.name", "model.name", "partition.name", "seed", "num_clients")


class ResumeError(ValueError):
    """A resume request that cannot be honoured; the message says why and what to do."""


@dataclass
class Checkpoint:
    round: int
    arrays: dict[str, np.ndarray]
    meta: dict  # the strategy's metadata (its history among others)
    identity: dict
    path: Path


def identity(cfg) -> dict:
    return {key: _plain(OmegaConf.select(cfg, key)) for key in IDENTITY_KEYS}


def save(run_dir: str | Path, *, server_round: int, cfg, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write ``run_dir/checkpoint.npz`` atomically; returns its path."""
    run_dir = Path(run_dir)
    target = run_dir / CHECKPOINT
    tmp = run_dir / f".{CHECKPOINT}.tmp"
    header = {"format": FORMAT, "round": int(server_round), "identity": identity(cfg), "strategy": meta}
    payload = {f"{_PREFIX}{k}": np.ascontiguousarray(v) for k, v in arrays.items()}
    payload[_META] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with open(tmp, "wb") as handle:
        os.fchmod(handle.fileno(), file_mode())  # private before a byte is written (fedapps.filemodes)
        np.savez(handle, **payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
    return target


def load(run_dir: str | Path) -> Checkpoint:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ResumeError(f"{path} does not exist: the run folder has no checkpoint to resume from")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data[_META]).decode())
            arrays = {k[len(_PREFIX):]: data[k] for k in data.files if k.startswith(_PREFIX)}
    except (OSError, ValueError, KeyError) as err:
        raise ResumeError(f"{path} is not a readable Postcard checkpoint: {err}") from None
    if header.get("format") != FORMAT:
        raise ResumeError(f"{path} has checkpoint format {header.get('format')}, this version reads {FORMAT}")
    return Checkpoint(int(header["round"]), arrays, dict(header.get("strategy", {})), dict(header["identity"]), path)


def resume_folder(cfg) -> tuple[Path | None, bool]:
    """(run folder to use, whether it must already hold a checkpoint) for ``cfg.resume``.

    ``(None, False)``: a fresh run in a new folder (``resume`` unset or false).
    """
    value = cfg.get("resume")
    if value is None or value is False or str(value).lower() in ("", "false", "none", "null"):
        return None, False
    if value is True or str(value).lower() in ("auto", "true"):
        if not cfg.get("run_name"):
            raise ResumeError("resume=auto needs a fixed run_name (the folder to continue), "
                              "e.g. overrides='run_name=exp1 resume=auto'")
        return output_root(cfg) / str(cfg.run_name), False
    folder = Path(str(value)).expanduser()
    if not folder.is_absolute():
        folder = output_root(cfg) / folder
    if not (folder / CHECKPOINT).is_file():
        raise ResumeError(f"resume={value}: {folder / CHECKPOINT} does not exist (give a run folder "
                          "written by a run of this version, or resume=auto with a run_name)")
    return folder, True


def open_run_dir(cfg, resume_dir: Path | None, must_exist: bool) -> tuple[RunDir, Checkpoint | None]:
    """The run's folder (new, or the one ``resume`` names, reopened) and the checkpoint to continue from."""
    if resume_dir is None:
        return RunDir(cfg), None
    if must_exist or (resume_dir / CHECKPOINT).is_file():
        checkpoint = load(resume_dir)
        check_compatible(checkpoint, cfg)
        return RunDir.reopen(cfg, resume_dir, checkpoint.meta.get("history", [])), checkpoint
    log(INFO, "resume=auto: %s has no checkpoint yet; starting the run there", resume_dir)
    return RunDir.reopen(cfg, resume_dir, []), None


def check_compatible(checkpoint: Checkpoint, cfg) -> None:
    now = identity(cfg)
    diff = {k: (checkpoint.identity.get(k), now[k]) for k in IDENTITY_KEYS if checkpoint.identity.get(k) != now[k]}
    if diff:
        detail = ", ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in diff.items())
        raise ResumeError(f"cannot resume {checkpoint.path.parent}: a different experiment ({detail})")


def _plain(value):
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value
