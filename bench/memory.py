"""One client's local training in a fresh process, its peak memory and speed measured around it.

Shared by the benchmarks that report client memory (``bench/smartfed.py``,
``bench/lm_memory.py``): :func:`measure_memory` writes the composed config to a file and
runs ``python bench/memory.py CONFIG`` (:func:`memory_probe`), which builds the method's
client model (the method's own ``prepare``; a SmartFed client also loads a downlink),
resets the peak resident memory once the model is loaded (Linux ``clear_refs``), trains
``steps`` local steps on the first client's data and reports the peak (``VmHWM``), the
part above the loaded backbone, the trainable state and seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset VmHWM (peak RSS) to the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def memory_probe(config_path: str, downlink_path: str | None, steps: int) -> dict:
    """Runs in a fresh process: one client's local training, memory measured around it."""
    import torch

    from clients.tasks import make_task
    from clients.train import local_train
    from fedapps import registry
    from fedapps.config import from_yaml

    cfg = from_yaml(Path(config_path).read_text())
    torch.set_num_threads(1)
    model, tok, _ = registry.get(str(cfg.algorithm.name)).prepare(cfg)
    task = make_task(cfg, 0, int(cfg.num_clients or cfg.task.default_clients), tok)
    if downlink_path:  # SmartFed: the experts and routers a client receives in round 1
        from safetensors.numpy import load_file

        from clients.smartfed.more import load_mixture
        from fedapps.smartfed import more_config

        load_mixture(model, load_file(downlink_path), more_config(cfg))
    from clients.train import place_model

    model = place_model(model, torch.device("cpu"), frozen_bf16=bool(cfg.train.get("frozen_bf16", False)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    backbone_kb = _status_kb("VmRSS")
    _reset_peak()
    train_cfg = cfg.train.copy()
    train_cfg.local_steps = steps
    start = time.perf_counter()
    metrics = local_train(model, task, train_cfg, seed=0)
    seconds = (time.perf_counter() - start) / steps
    peak_kb = _status_kb("VmHWM")
    return {
        "algorithm": str(cfg.algorithm.name),
        "rss_after_load_mb": backbone_kb / 1024,
        "peak_rss_mb": peak_kb / 1024,
        "peak_above_backbone_mb": (peak_kb - backbone_kb) / 1024,
        "trainable_values": int(trainable),
        "trainable_state_mb": trainable * 4 * 4 / 2**20,
        "seconds_per_step": seconds,
        "loss": float(metrics["loss"]),
    }


def measure_memory(cfg, workdir: Path, steps: int, downlink: dict | None = None, name: str | None = None) -> dict:
    """Run :func:`memory_probe` in a child process (a clean peak for each configuration)."""
    from fedapps.config import to_yaml

    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{name or cfg.algorithm.name}.yaml"
    config_path.write_text(to_yaml(cfg))
    command = [sys.executable, str(Path(__file__).resolve()), str(config_path), "--steps", str(steps)]
    if downlink is not None:
        from safetensors.numpy import save_file

        path = workdir / f"{name or cfg.algorithm.name}-downlink.safetensors"
        save_file({k: v.copy() for k, v in downlink.items()}, str(path))
        command += ["--downlink", str(path)]
    # glibc keeps freed blocks (RSS then reflects the allocator's history, not live memory);
    # a fixed mmap threshold returns every block >= 64 KiB to the system when it is freed
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe of {name or cfg.algorithm.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="a composed run config (YAML)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--downlink", default=None, help="SmartFed: the round-1 downlink (safetensors)")
    args = p.parse_args(argv)
    print(json.dumps(memory_probe(args.config, args.downlink, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
