"""The plots, ``--write-docs`` (the report into docs/fednl.md between its bench markers, the plots into
docs/) and ``--render`` (earlier results.json files reported again, nothing run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .passkey import passkey_lines
from .retrieval import retrieval_lines
from .report import label_of, report, section_times
from .runs import MODULE, ROOT, log

DOC_START, DOC_END = "<!-- bench:fednl:start -->", "<!-- bench:fednl:end -->"
LEGACY = "python bench/fednl.py "  # how results made before #40 record their command


def plots(results: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finish(fig, ax, path: Path) -> Path:
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    made = []
    stream = results.get("stream")
    if not stream:
        return made
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, r in stream.items():
        if r["relative_ce"]:
            ax.plot(range(1, len(r["relative_ce"]) + 1), r["relative_ce"], marker="o", label=label_of(key, r))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="1K-token bin", ylabel="CE / CE of the first bin", title="Streaming cross-entropy")
    made.append(finish(fig, ax, folder / "fednl-stream-ce.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, r in stream.items():
        xs = sorted(int(x) for x in r["peak_bytes"])
        ax.plot(xs, [r["peak_bytes"][str(x)] / 1e6 for x in xs], marker="o", label=label_of(key, r))
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context length (tokens)", ylabel="peak inference memory above the model (MB)",
           title="Peak inference memory")
    made.append(finish(fig, ax, folder / "fednl-memory.png"))
    return made


def write_docs(text: str, images: list[Path]) -> None:
    docs = ROOT / "docs" / "fednl.md"
    content = docs.read_text()
    if DOC_START not in content or DOC_END not in content:
        raise SystemExit(f"{docs} has no {DOC_START} ... {DOC_END} markers")
    refs = "\n".join(f"![{p.stem}]({p.name})" for p in images)
    head, rest = content.split(DOC_START, 1)
    _, tail = rest.split(DOC_END, 1)
    docs.write_text(f"{head}{DOC_START}\n{text}\n{refs}\n{DOC_END}{tail}")
    log(f"wrote {docs}")


def command_of(results: dict) -> str:
    """The command a result records, as it runs today: results made before the benchmark became the
    package bench/fednl/ (#40) record ``python bench/fednl.py ...``, the same flags as ``python -m bench.fednl ...``."""
    command = results.get("command", "(command not recorded)")
    return f"python -m {MODULE} " + command[len(LEGACY):] if command.startswith(LEGACY) else command


def render(args) -> None:
    """Tables and plots of earlier runs (their results.json), one block per run, in order."""
    texts, images = [], []
    for path in args.render.split(","):
        results = json.loads(Path(path).read_text())
        run_args = argparse.Namespace(**results["args"])
        texts.append(report(run_args, results, command_of(results)) + passkey_lines(results.get("passkey"))
                     + retrieval_lines(results.get("retrieval")))
        if "section_seconds" in results:
            texts[-1] += section_times(results["section_seconds"])
        if results.get("stream"):
            images = plots(results, ROOT / "docs" if args.write_docs else Path(path).parent)
    text = "\n".join(texts)
    print(text)
    if args.write_docs:
        write_docs(text, images)
