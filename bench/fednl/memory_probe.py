"""Would FedNL's delta-rule memory recall the passkey, before any training? A probe of the untrained backbone.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.fednl.memory_probe --out docs/bench/fednl/memory-probe.json

Validation ``task=passkey`` prompts (never the test ones) go through the backbone with full attention; each
layer's own q/k/v projections (before RoPE, as the memory path reads them) are then written, token by
token, into a delta-rule memory (``clients.fednl.deltarule.delta_rule_recurrent``, one memory per key/value
head, a constant write strength β), and the memory is read with the query that predicts the key's first
digit (the answer's first token). The readout's *rank* says how well the memory recalls: the number of the
prompt's values (one per token) closer to the readout, by cosine, than the value of the needle's first
digit; 0 is perfect recall, about half the prompt is chance. Reported per layer: the best query head's
rank, median over the prompts, for each way of forming the memory's keys:

* ``silu`` / ``identity``: the activation before the L2 norm (``algorithm.memory.qk_activation``);
* ``+ centred``: keys minus their causal running mean (``algorithm.memory.key_centering``,
  ``clients.fednl.layer.centre_keys``);

and the keys' mean pairwise cosine within a prompt (how much one write overlaps every other).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .runs import load_trained, log

VARIANTS = {  # name: (activation, centred keys, beta)
    "silu, beta 0.5": ("silu", False, 0.5),
    "identity, beta 0.5": ("identity", False, 0.5),
    "silu + centred, beta 0.5": ("silu", True, 0.5),
    "identity + centred, beta 0.5": ("identity", True, 0.5),
    "identity + centred, beta 1": ("identity", True, 1.0),
}


def attentions(model) -> list:
    return [m for m in model.modules() if all(hasattr(m, f"{n}_proj") for n in "qkvo")]


def probe(model, task, indices, variants=VARIANTS) -> dict:
    """For each variant: ``rank`` (prompts x layers, the best head's rank of the first digit's value) and
    ``key_cosine`` (prompts x layers, the mean pairwise cosine of the memory's keys)."""
    import torch
    import torch.nn.functional as F

    from clients.fednl.deltarule import delta_rule_recurrent, l2_normalize
    from clients.fednl.layer import centre_keys

    layers = attentions(model)
    captured: dict = {}
    hooks = [getattr(attn, f"{n}_proj").register_forward_hook(
        lambda _m, _x, y, i=i, n=n: captured.__setitem__((n, i), y.detach().float()))
        for i, attn in enumerate(layers) for n in "qkv"]
    out = {name: {"rank": [], "key_cosine": []} for name in variants}
    try:
        for index in indices:
            batch = task.collate([int(index)])
            ids, labels = batch["input_ids"][0], batch["labels"][0]
            query_at = int((labels != -100).nonzero()[1, 0])  # the input position whose next token is digit 1
            digit, space = int(labels[query_at]), int(labels[query_at - 1])
            needle = next(t for t in range(1, query_at) if ids[t] == digit and ids[t - 1] == space)
            with torch.no_grad():
                model(ids[None, : query_at + 1])
            for name, (activation, centred, beta) in variants.items():
                ranks, cosines = [], []
                for i, attn in enumerate(layers):
                    head_dim = attn.head_dim
                    q = captured[("q", i)][0].view(query_at + 1, -1, head_dim).transpose(0, 1)[None]  # (1, H, T, d)
                    k = captured[("k", i)][0].view(query_at + 1, -1, head_dim).transpose(0, 1)[None]  # (1, KV, T, d)
                    v = captured[("v", i)][0].view(query_at + 1, -1, head_dim).transpose(0, 1)[None]
                    if activation == "silu":
                        q, k = F.silu(q), F.silu(k)
                    if centred:
                        k = centre_keys(k, None)[0]
                    q, k = l2_normalize(q), l2_normalize(k)
                    o, _ = delta_rule_recurrent(q, k, v, torch.full(k.shape[:3], beta))
                    groups = q.shape[1] // k.shape[1]
                    values = F.normalize(v[0].repeat_interleave(groups, 0)[:, :query_at], dim=-1)  # (H, T, d)
                    cos = values @ F.normalize(o[0, :, query_at], dim=-1)[:, :, None]  # (H, T, 1)
                    ranks.append(int((cos[:, :, 0] > cos[:, needle : needle + 1, 0]).sum(1).min()))
                    keys = k[0, :, 1:]  # (the first key of a centred run is 0)
                    gram = keys @ keys.transpose(1, 2)
                    n = keys.shape[1]
                    cosines.append(float(((gram.sum((1, 2)) - gram.diagonal(dim1=1, dim2=2).sum(1)) / (n * (n - 1))).mean()))
                out[name]["rank"].append(ranks)
                out[name]["key_cosine"].append(cosines)
    finally:
        for hook in hooks:
            hook.remove()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fednl.memory_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--per-filler", type=int, default=3, help="validation prompts per filler")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--min-distance", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="the JSON report")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from clients.tasks import make_task
    from fedapps.config import compose

    torch.set_num_threads(args.threads)
    cfg = compose([f"model={args.model}", "seed=42", "num_clients=1", "task.train_per_filler=1",
                   f"task.train_lengths=[{args.length}]", f"task.val_per_filler={args.per_filler}",
                   f"task.val_lengths=[{args.length}]", "task.eval_split=val",
                   f"task.min_distance={args.min_distance}"], task="passkey", algorithm="fedavg-lora")
    model, tokenizer = load_trained(cfg, {})
    task = make_task(cfg, 0, 1, tokenizer)
    result = probe(model, task, task.test_idx)
    report = {"model": args.model, "length": args.length, "prompts": len(task.test_idx), "split": "val",
              "variants": {}}
    for name, r in result.items():
        median = np.median(np.asarray(r["rank"]), axis=0)
        report["variants"][name] = {**r, "median_rank": median.tolist(),
                                    "key_cosine_mean": float(np.mean(r["key_cosine"]))}
        log(f"{name:30s} key cosine {np.mean(r['key_cosine']):.2f}; best head's rank per layer (median): "
            f"{' '.join(str(int(x)) for x in median)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
