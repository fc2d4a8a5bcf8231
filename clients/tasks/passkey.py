"""Passkey retrieval: a 5-digit key hidden in filler text, recalled at the end (``task=passkey``).

The classic passkey-retrieval prompt (Mohtashami & Jaggi, 2023)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize it.
    I will quiz you about the important information there.

    <filler> The pass key is 52817. Remember it. 52817 is the pass key. <filler>

    What is the pass key? The pass key is

and the answer `` 52817`` (SmolLM2's tokenizer: a space and one token per digit). Fillers
(``FILLERS``): ``grass`` repeats "The grass is green. The sky is blue. The sun is yellow. Here
we go. There and back again." (the classic one, starting at a random sentence of the five);
``shakespeare`` is a contiguous run of spoken lines from the embedded plays (NIAH's haystack,
:func:`clients.tasks.niah.filler_units`). Lengths are tokens of the given tokenizer, counted with
NIAH's machinery (:func:`clients.tasks.niah.token_counter`); the prompt has at most
``length_tokens`` tokens, usually exactly that many. The needle sits at a filler boundary at a depth
drawn uniformly from ``depth`` (fractions of the context), moved earlier when fewer than
``min_distance`` tokens would follow it: the answer position then lies at least ``min_distance``
tokens after the needle's last token (``distance`` in the example), beyond a softmax window of fewer
tokens. Mind that stacked windowed layers reach further back than one window (L layers x W tokens).

Scoring (:func:`clients.tasks.passkey_task.exact_match`): teacher forcing, one forward pass over prompt + answer; the answer is
right when every answer token is the argmax given the prompt and the answer tokens before it, i.e.
exactly when greedy decoding produces it. Training puts the LM loss on the answer tokens only.
Examples are seeded by ``(split, seed, filler, index)`` strings, so the train / val / test splits
never share a generator seed (:func:`split_seed_key`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from clients.partition import EVAL_SPLITS
from clients.tasks.niah import _take_filler, filler_units, fit_to_length, token_counter

FILLERS = ("grass", "shakespeare")
SPLITS = ("train", "val", "test")
GRASS = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
DIGITS = 5


def units_of(filler: str) -> tuple[str, ...]:
    """The filler's sentence-sized units, in order (a prompt takes a contiguous run, wrapping around)."""
    if filler == "grass":
        return GRASS
    if filler == "shakespeare":
        return filler_units()
    raise ValueError(f"unknown passkey filler {filler!r}; choose one of {FILLERS}")


def split_seed_key(split: str, seed: int, filler: str, index: int) -> str:
    """The string that seeds example ``index`` of one split: distinct splits never share one."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    return f"passkey:{split}:{seed}:{filler}:{index}"


def make_example(filler: str, length_tokens: int, rng: random.Random | int | str, tokenizer, *,
                 depth: Sequence[float] = (0.05, 0.6), min_distance: int = 0) -> dict:
    """One passkey prompt of at most ``length_tokens`` tokens (the answer not counted).

    Returns a dict: ``prompt``, ``answer`` (`` 52817``), ``key``, ``filler``, ``needle_position``
    (the needle's character span in ``prompt``), ``depth`` (tokens of the context before the needle /
    the context's tokens), ``target_depth``, ``distance`` (tokens from the needle's end to the prompt's
    end), ``length_tokens`` (the target) and ``num_tokens`` (the prompt's count).
    """
    if isinstance(length_tokens, bool) or not isinstance(length_tokens, int) or length_tokens <= 0:
        raise ValueError(f"length_tokens must be a positive int, got {length_tokens!r}")
    lo, hi = (float(d) for d in depth)
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"depth must be [low, high] with 0 <= low <= high <= 1, got {list(depth)}")
    units = units_of(filler)
    if not isinstance(rng, random.Random):
        rng = random.Random(rng)
    count = token_counter(tokenizer)

    key = str(rng.randint(10 ** (DIGITS - 1), 10**DIGITS - 1))
    needle = NEEDLE.format(key=key)
    target = rng.uniform(lo, hi)
    start = rng.randrange(len(units))
    needle_size, question_size = count(" " + needle), count(QUESTION)
    fixed = count(HEADER) + needle_size + question_size
    budget = length_tokens - fixed
    if budget < max(16, min_distance - question_size):
        raise ValueError(f"length_tokens={length_tokens} is too short for a passkey prompt with the key "
                         f">= {min_distance} tokens from the end: header, needle and question take {fixed} tokens; "
                         f"use at least {fixed + max(16, min_distance - question_size)}")
    def build(budget: int) -> tuple:
        taken, sizes = _take_filler(start, budget, count, units)
        prefix = [0]
        for size in sizes:
            prefix.append(prefix[-1] + size)
        total = prefix[-1]
        b = min(max(bisect.bisect_left(prefix, target * total), 0), len(taken))
        if b > 0 and target * total - prefix[b - 1] <= prefix[min(b, len(taken))] - target * total:
            b -= 1
        while b > 0 and total - prefix[b] + question_size < min_distance:  # keep the key far enough back
            b -= 1
        while True:  # (piece counts are estimates: move the needle back until the whole's count agrees)
            before, after = " ".join(taken[:b]), " ".join(taken[b:])
            context = " ".join(part for part in (before, needle, after) if part)
            prompt = HEADER + context + QUESTION
            num_tokens = count(prompt)
            end = len(HEADER) + len(before) + (1 if before else 0) + len(needle)
            if b == 0 or num_tokens - count(prompt[:end]) >= min_distance:
                return num_tokens, prompt, context, before
            b -= 1

    num_tokens, prompt, context, before = fit_to_length(build, budget, length_tokens, "passkey")
    begin = len(HEADER) + len(before) + (1 if before else 0)
    end = begin + len(needle)
    distance = num_tokens - count(prompt[:end])
    if distance < min_distance:
        raise ValueError(f"length_tokens={length_tokens}: the key lies {distance} tokens from the end, "
                         f"fewer than min_distance={min_distance}; use longer prompts or a smaller min_distance")
    return {
        "prompt": prompt,
        "answer": ANSWER.format(key=key),
        "key": key,
        "filler": filler,
        "needle_position": (begin, end),
        "depth": count(before) / max(count(context), 1) if before else 0.0,
        "target_depth": target,
        "distance": distance,
        "length_tokens": length_tokens,
        "num_tokens": num_tokens,
    }


def split_example(split: str, index: int, filler: str, lengths: Sequence[int], seed: int, tokenizer,
                  **kwargs) -> dict:
    """Example ``index`` of a split: its length cycles through ``lengths``; its generator is seeded by
    :func:`split_seed_key` (reproducible, independent of how many examples the split has)."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError("lengths must name at least one target length")
    rng = random.Random(split_seed_key(split, seed, filler, index))
    return make_example(filler, int(lengths[index % len(lengths)]), rng, tokenizer, **kwargs)


def _lengths(value, key: str) -> tuple[int, ...]:
    from clients.tasks.base import TaskError

    try:
        lengths = tuple(int(v) for v in (value or ()))
    except (TypeError, ValueError):
        lengths = ()
    if not lengths or any(v <= 0 for v in lengths):
        raise TaskError(f"task.{key} must list positive token lengths, got {value!r}")
    return lengths


def task_settings(cfg) -> dict:
    """``cfg.task`` checked: fillers, lengths and counts per split, depth range, min_distance and the held-out
    split; with FedNL's softmax window, every length and ``min_distance`` must exceed the window (else the
    key would sit inside the window, or no token beyond it). Raises TaskError naming the fix."""
    from clients.tasks.base import TaskError

    task = cfg.task
    fillers = [str(f) for f in task.fillers]
    unknown = sorted(set(fillers) - set(FILLERS))
    if unknown or not fillers or len(set(fillers)) != len(fillers):
        raise TaskError(f"task.fillers must be distinct names from {FILLERS}, got {fillers}")
    held_out = str(task.get("eval_split", "test"))
    if held_out not in EVAL_SPLITS:
        raise TaskError(f"task.eval_split must be {' or '.join(EVAL_SPLITS)}, got {held_out!r}")
    lengths = {"train": _lengths(task.train_lengths, "train_lengths"),
               held_out: _lengths(task.get(f"{held_out}_lengths"), f"{held_out}_lengths")}
    counts = {"train": int(task.train_per_filler), held_out: int(task.get(f"{held_out}_per_filler") or 0)}
    if min(counts.values()) <= 0:
        raise TaskError(f"task.train_per_filler and task.{held_out}_per_filler must be > 0, got {counts}")
    depth = [float(d) for d in task.depth]
    if len(depth) != 2 or not 0.0 <= depth[0] <= depth[1] <= 1.0:
        raise TaskError(f"task.depth must be [low, high] with 0 <= low <= high <= 1, got {depth}")
    min_distance = int(task.min_distance)
    if min_distance < 0:
        raise TaskError(f"task.min_distance must be >= 0, got {min_distance}")
    algorithm = cfg.get("algorithm") or {}
    # a method whose attention sees only a window (FedNL's algorithm.memory.window): the key must lie beyond it
    window = (algorithm.get("memory") or {}).get("window")
    if window is not None:
        shortest = min(min(v) for v in lengths.values())
        if shortest <= int(window):
            raise TaskError(f"task=passkey: a {shortest}-token prompt is no longer than the method's softmax window "
                            f"(algorithm.memory.window={window}): nothing lies beyond it; use longer lengths")
        if min_distance <= int(window):
            raise TaskError(f"task.min_distance={min_distance} lets the key sit inside the method's softmax window "
                            f"(algorithm.memory.window={window}); set task.min_distance above the window")
    return {"fillers": fillers, "held_out": held_out, "lengths": lengths, "counts": counts,
            "depth": tuple(depth), "min_distance": min_distance}
