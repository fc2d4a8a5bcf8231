"""Section 3, ``stream``: one long NIAH prompt streamed block by block through each model, each in
a fresh process (``--stream-worker``): cross-entropy per 1K-token bin and peak inference memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .niah import niah_cfg
from .runs import MODULE, ROOT, load_trained, log, spec_key


def stream_worker(spec_json: str) -> None:
    """In a fresh process: stream one long prompt, print one JSON line of results."""
    import torch

    from clients.fednl import FedNLStreamer, KVCacheStreamer, binned_nll, relative_ce, streamed_nll
    from clients.fednl.diagnostics import PeakMemory
    from clients.tasks.niah import make_example
    from fedapps.config import from_yaml

    spec = json.loads(spec_json)
    torch.set_num_threads(int(spec["threads"]))
    cfg = from_yaml(Path(spec["config"]).read_text())
    model, tokenizer = load_trained(cfg, {"final_state": spec["final_state"]})
    # one token more than the stream's length, so that every one of its tokens is scored
    example = make_example("passkey", int(spec["length"]) + 1, int(spec["seed"]), tokenizer)
    ids = torch.tensor([tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]])
    if spec["method"] == "fednl":
        def make():
            return FedNLStreamer(model, block=int(spec["block"]), form="recurrent")
    else:
        def make():
            return KVCacheStreamer(model, block=int(spec["block"]))
    streamed_nll(make(), ids[:, : int(spec["block"]) * 2])  # warm-up (kernels, allocator)
    lengths = [int(x) for x in spec["memory_lengths"]]
    peaks, states = {}, {}
    streamer = make()
    start = time.time()
    total = int(ids.shape[1])  # the prompt fits its target length, usually exactly
    with PeakMemory() as peak:
        def sample(done: int) -> None:
            for length in lengths:
                if (done >= length or done == total) and length not in peaks:
                    peaks[length] = peak.sample()
                    states[length] = streamer.state_bytes()

        nll = streamed_nll(streamer, ids, on_block=sample)
    result = {
        "method": spec["method"],
        "tokens": int(ids.shape[1]),
        "seconds": time.time() - start,
        "model_rss_bytes": peak.start,
        "peak_bytes": {str(k): v for k, v in peaks.items()},
        "state_bytes": {str(k): v for k, v in states.items()},
        "bins": binned_nll(nll, 1024) if nll.shape[1] >= 1024 else [],
        "relative_ce": relative_ce(nll, 1024) if nll.shape[1] >= 1024 else [],
        "measure": "peak RSS above the RSS with the model loaded",
    }
    print("RESULT " + json.dumps(result), flush=True)


def section_stream(args, out: Path, niah: dict | None, algorithms=None) -> dict:
    """Each model of ``niah`` (run folders by key: the NIAH or the lm section's) streamed in a fresh
    process, or with ``niah=None`` the untrained ones."""
    from fedapps.config import to_yaml

    results = {}
    for spec in algorithms or args.niah_algorithms:
        key = spec_key(spec)
        method = "fednl" if spec.startswith("fednl") else "kv"
        if niah is not None:
            config, final_state = str(Path(niah[key]["run_dir"]) / "config.yaml"), niah[key]["final_state"]
        else:  # untrained: FedNL at init with the window (its ablation: the windowed backbone), the bare backbone
            config, final_state = str(out / f"stream_{key}.yaml"), None
            Path(config).write_text(to_yaml(niah_cfg(args, out, spec, f"stream_{key}")))
        spec = {
            "method": method, "config": config, "final_state": final_state,
            "length": args.stream_length, "block": args.block, "seed": args.seed + 7,
            "memory_lengths": args.memory_lengths, "threads": args.threads,
        }
        log(f"stream: {key} ({'recurrent FedNL' if method == 'fednl' else 'KV cache'}), {args.stream_length} tokens")
        proc = subprocess.run([sys.executable, "-m", MODULE, "--stream-worker", json.dumps(spec)],
                              capture_output=True, text=True, cwd=str(ROOT))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"stream worker for {key} failed:\n{proc.stderr[-3000:]}")
        results[key] = json.loads(lines[-1][len("RESULT "):])
        name = {"fednl": "FedNL recurrent", "fednl-ablate": "FedNL ablation (memory off) recurrent"}.get(
            key, f"{key} + KV cache" if niah is not None else "backbone + KV cache")
        results[key]["label"] = name + (" (at init)" if niah is None and method == "fednl" else "")
        log(f"stream {key}: {results[key]['seconds']:.0f} s, peak {results[key]['peak_bytes']}")
    return results
