"""Section 4, ``throughput``: training tokens/s of FedNL vs plain LoRA on q/k/v, interleaved timed
steps, and (``--throughput-profile``) where FedNL's extra time goes, by operator."""

from __future__ import annotations

import time

from .runs import log


def section_throughput(args) -> dict:
    """Training tokens/s of plain LoRA q/k/v (fedavg-lora on q/k/v, same rank) and FedNL, with its default
    ``algorithm.memory.memory_heads`` and each other mode of ``--throughput-memory-heads`` (and extra chunk
    sizes), timed in one interleaved loop: each round runs one step of every model, so load changes on a
    shared machine hit them alike; the ratio to LoRA is also taken round by round (median and range)."""
    import os
    import statistics

    import torch

    from fedapps import baselines, fednl
    from fedapps.config import compose

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    base = [f"model={args.model}", f"seed={args.seed}"]
    fednl_cfg = compose(base, algorithm="fednl", task="mmlu")
    lora_cfg = compose([*base, "algorithm.lora.target_modules=[q_proj,k_proj,v_proj]"], algorithm="fedavg-lora",
                       task="mmlu")
    chunk = int(fednl_cfg.algorithm.memory.chunk_size)
    heads = str(fednl_cfg.algorithm.memory.get("memory_heads", "query"))
    models = {"fednl": fednl.prepare(fednl_cfg)[0], "lora-qkv": baselines.prepare(lora_cfg)[0]}
    for mode in (m for m in getattr(args, "throughput_memory_heads", []) if m != heads):
        cfg = compose([*base, f"algorithm.memory.memory_heads={mode}"], algorithm="fednl", task="mmlu")
        models[f"fednl memory_heads={mode}"] = fednl.prepare(cfg)[0]
    for extra in (c for c in args.throughput_chunks if c != chunk):
        cfg = compose([*base, f"algorithm.memory.chunk_size={extra}"], algorithm="fednl", task="mmlu")
        models[f"fednl chunk {extra}"] = fednl.prepare(cfg)[0]
    for variant in getattr(args, "throughput_variants", []):
        cfg = compose([*base, *variant], algorithm="fednl", task="mmlu")
        models["fednl " + " ".join(variant)] = fednl.prepare(cfg)[0]
    vocab = models["fednl"].get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.throughput_batch, args.throughput_seq), generator=generator)
    optimizers = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for k, m in models.items()}

    def step(key: str) -> tuple[float, float]:
        """One training step: (wall seconds, CPU seconds of this process)."""
        model, optimizer = models[key], optimizers[key]
        wall, cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - wall, time.process_time() - cpu

    for key in models:  # warm-up
        step(key)
    log(f"throughput: {len(models)} models warm, timing {args.throughput_steps} interleaved rounds")
    times = {k: [] for k in models}
    order = list(models)
    for repeat in range(args.throughput_steps):  # interleaved, so load changes hit every model alike
        for key in (order if repeat % 2 == 0 else order[::-1]):  # and alternating the order within a round
            times[key].append(step(key))
        log(f"throughput round {repeat + 1}/{args.throughput_steps}: wall s per step "
            + ", ".join(f"{k} {v[-1][0]:.2f}" for k, v in times.items()) + f"; load average {os.getloadavg()[0]:.2f}")
    load_after = os.getloadavg()
    tokens = args.throughput_batch * args.throughput_seq
    # wall-clock tokens/s, and tokens per CPU-second (robust to other load on a shared machine)
    rates = {k: tokens / (sum(w for w, _ in v) / len(v)) for k, v in times.items()}
    cpu_rates = {k: tokens / (sum(c for _, c in v) / len(v)) for k, v in times.items()}

    def per_round(key: str, which: int) -> list[float]:  # LoRA's step time / this model's, round by round
        return [lo[which] / mine[which] for lo, mine in zip(times["lora-qkv"], times[key])]

    ratios = {}
    for key in (k for k in models if k != "lora-qkv"):
        ratios[key] = {name: {"mean": (rates if which == 0 else cpu_rates)[key]
                              / (rates if which == 0 else cpu_rates)["lora-qkv"],
                              "median": statistics.median(per_round(key, which)),
                              "min": min(per_round(key, which)), "max": max(per_round(key, which))}
                       for which, name in ((0, "wall"), (1, "cpu"))}
    log(f"throughput: wall {rates}, per CPU-second {cpu_rates}, ratios to lora-qkv {ratios}, "
        f"load average {load_before} -> {load_after}")
    result = {"tokens_per_second": rates, "ratio": rates["fednl"] / rates["lora-qkv"],
              "tokens_per_cpu_second": cpu_rates, "cpu_ratio": cpu_rates["fednl"] / cpu_rates["lora-qkv"],
              "ratios": ratios, "memory_heads": heads, "load_average": [list(load_before), list(load_after)],
              "step_seconds": {k: [list(x) for x in v] for k, v in times.items()},
              "batch": args.throughput_batch, "seq": args.throughput_seq, "steps": args.throughput_steps,
              "chunk_size": chunk, "threads": args.threads,
              "trainable": {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in models.items()}}
    if args.throughput_profile:
        result["profile"] = step_profile({k: (lambda k=k: step(k)) for k in ("fednl", "lora-qkv")})
    return result


def step_profile(steps: dict, top: int = 14) -> dict:
    """Self CPU time per operator (ms per step, mean of 2 profiled steps) of each model's training step,
    and the operators where the first model spends the most beyond the second."""
    from torch.profiler import ProfilerActivity, profile

    per_op = {}
    for key, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            step()
        per_op[key] = {e.key: (e.self_cpu_time_total / 2e3, e.count // 2) for e in prof.key_averages()}
    first, second = list(per_op)
    extra = sorted(set(per_op[first]) | set(per_op[second]),
                   key=lambda op: per_op[second].get(op, (0, 0))[0] - per_op[first].get(op, (0, 0))[0])
    return {"models": [first, second],
            "total_ms": {k: sum(ms for ms, _ in ops.values()) for k, ops in per_op.items()},
            "ops": [{"op": op, **{k: per_op[k].get(op, (0.0, 0)) for k in (first, second)}} for op in extra[:top]]}


TARGET_RATIO = 0.9  # issue #44 item 6: FedNL trains at >= 0.9x plain LoRA q/k/v's tokens/s


def round_ratio(tp: dict, key: str, which: str = "wall") -> dict:
    """``key``'s speed relative to plain LoRA q/k/v, round by round (LoRA's step time / this model's, from
    the result's ``step_seconds``): mean, 95% t interval, and the verdict against :data:`TARGET_RATIO` by
    ``bench.protocol.verdict`` (the interval's lower bound must reach it)."""
    from bench import protocol

    from .stats import t_interval

    at = 0 if which == "wall" else 1
    ratios = [lo[at] / mine[at] for lo, mine in zip(tp["step_seconds"]["lora-qkv"], tp["step_seconds"][key])]
    stats = t_interval(ratios) if len(ratios) > 1 else {"mean": ratios[0], "ci95": None}
    interval = None if stats["ci95"] is None else [v - 1 for v in stats["ci95"]]
    return {"mean": stats["mean"], "ci95": stats["ci95"], "rounds": len(ratios),
            "verdict": protocol.verdict(stats["mean"] - 1, interval, TARGET_RATIO - 1, kind="non-inferiority")}
