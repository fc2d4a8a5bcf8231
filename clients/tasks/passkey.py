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

Scoring (:func:`exact_match`): teacher forcing, one forward pass over prompt + answer; the answer is
right when every answer token is the argmax given the prompt and the answer tokens before it, i.e.
exactly when greedy decoding produces it. Training puts the LM loss on the answer tokens only.
Examples are seeded by ``(split, seed, filler, index)`` strings, so the train / val / test splits
never share a generator seed (:func:`split_seed_key`).
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from clients.tasks.base import Task

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


def exact_match(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced scoring of answers: ``logits`` ``[batch, T, vocab]`` (or the argmax ids
    ``[batch, T]``) at positions 0..T-1, ``labels`` ``[batch, T]`` the next token at each position
    (-100 where nothing is scored). Returns ``(exact, tokens)``: per row, 1 when every scored token is
    the argmax (= greedy decoding reproduces the answer), and the fraction of scored tokens that are."""
    predicted = logits.argmax(-1) if logits.dim() == 3 else logits
    scored = labels != -100
    hit = (predicted == labels) & scored
    n = scored.sum(-1)
    if bool((n == 0).any()):
        raise ValueError("a row has no scored (answer) token")
    return (hit.sum(-1) == n).float(), hit.sum(-1).float() / n




# --------------------------------------------------------------------------- the federated task
def answer_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Logits ``[N, vocab]`` at the N scored positions (``labels != -100``, row-major): the decoder runs
    once, the output layer only where an answer token is predicted."""
    from clients.models.llm import decoder_and_head

    scored = labels != -100
    decoder, head = decoder_and_head(model)
    if decoder is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[scored]
    return head(decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[scored])


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
    if held_out not in ("val", "test"):
        raise TaskError(f"task.eval_split must be test or val, got {held_out!r}")
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
    window = (algorithm.get("memory") or {}).get("window") if algorithm.get("name") == "fednl" else None
    if window is not None:
        shortest = min(min(v) for v in lengths.values())
        if shortest <= int(window):
            raise TaskError(f"task=passkey: a {shortest}-token prompt is no longer than FedNL's softmax window "
                            f"(algorithm.memory.window={window}): nothing lies beyond it; use longer lengths")
        if min_distance <= int(window):
            raise TaskError(f"task.min_distance={min_distance} lets the key sit inside FedNL's softmax window "
                            f"(algorithm.memory.window={window}); set task.min_distance above the window")
    return {"fillers": fillers, "held_out": held_out, "lengths": lengths, "counts": counts,
            "depth": tuple(depth), "min_distance": min_distance}


class PasskeyTask(Task):
    """One client's passkey prompts: training prompts and held-out ones (``task.eval_split``: ``test``,
    or ``val`` for tuning), split among clients by filler (``label: filler``; natural = one filler per
    client) or by the partition group's iid/Dirichlet. Metrics: ``accuracy`` (exact match of the key,
    teacher-forced = greedy), ``token-accuracy`` (answer tokens that are the argmax), ``loss`` (mean
    answer-token cross-entropy), ``accuracy-<L>`` per prompt length, ``num-examples``."""

    metric = "accuracy"
    higher_is_better = True

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer) -> None:
        from clients.partition import partition_for
        from clients.tasks.base import TaskError
        from clients.tasks.text import special_affixes

        if tokenizer is None:
            raise TaskError(f"task 'passkey' needs a causal LM with a tokenizer; model '{cfg.model.name}' has none")
        settings = task_settings(cfg)
        self.fillers, self.lengths = settings["fillers"], settings["lengths"]
        self.depth, self.min_distance = settings["depth"], settings["min_distance"]
        self.seed = int(cfg.seed)
        self.tokenizer = tokenizer
        self.prefix = special_affixes(tokenizer)[0]
        self.entries: list[tuple[str, str, int]] = []  # (split, filler, index in the split)
        mine = {}
        for split, n in settings["counts"].items():
            if split == "train":
                pool = [(split, f, i) for f in self.fillers for i in range(n)]
            else:  # interleaved: a client that scores only its first batches sees every filler and length
                pool = [(split, f, i) for i in range(n) for f in self.fillers]
            chosen = partition_for(cfg, [f for _, f, _ in pool], num_partitions=num_partitions,
                                   partition_id=partition_id, natural_order=self.fillers, seed=self.seed)
            offset = len(self.entries)
            self.entries.extend(pool[int(i)] for i in sorted(chosen))
            mine[split] = np.arange(offset, len(self.entries))
        self.client_fillers = sorted({f for _, f, _ in self.entries})
        self._cache: dict[int, tuple[list[int], list[int], int]] = {}
        super().__init__(mine["train"], mine[settings["held_out"]])
        try:  # a length too short for the key's distance fails here, not mid-round
            for split in {s for s, _, _ in self.entries}:
                shortest = min(self.lengths[split])
                first = next(k for k, (s, _, i) in enumerate(self.entries)
                             if s == split and self.lengths[s][i % len(self.lengths[s])] == shortest)
                self._encoded(first)
        except StopIteration:
            pass
        except ValueError as err:
            raise TaskError(f"task=passkey: {err}") from None

    def example(self, index: int) -> dict:
        split, filler, i = self.entries[int(index)]
        return split_example(split, i, filler, self.lengths[split], self.seed, self.tokenizer,
                             depth=self.depth, min_distance=self.min_distance)

    def length_of(self, index: int) -> int:
        split, _, i = self.entries[int(index)]
        return self.lengths[split][i % len(self.lengths[split])]

    def _encoded(self, index: int) -> tuple[list[int], list[int], int]:
        index = int(index)
        if index not in self._cache:
            ex = self.example(index)
            prompt = self.prefix + self.tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
            answer = self.tokenizer(ex["answer"], add_special_tokens=False)["input_ids"]
            self._cache[index] = (prompt, answer, int(ex["length_tokens"]))
        return self._cache[index]

    def collate(self, indices):
        """Right-padded prompt + answer (its last token dropped); ``labels[t]`` is the token after position
        t where that is an answer token, -100 everywhere else (prompt and padding)."""
        encoded = [self._encoded(i) for i in indices]
        width = max(len(p) + len(a) - 1 for p, a, _ in encoded)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attention = torch.zeros((len(encoded), width), dtype=torch.long)
        labels = torch.full((len(encoded), width), -100, dtype=torch.long)
        for row, (prompt, answer, _) in enumerate(encoded):
            ids = prompt + answer[:-1]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, len(prompt) - 1 : len(ids)] = torch.tensor(answer)
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
                "length": torch.tensor([length for _, _, length in encoded])}

    def _answer(self, model, batch):
        """(logits at the answer positions [N, vocab], their targets [N], each one's row [N])."""
        scored = batch["labels"] != -100
        logits = answer_logits(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        return logits, batch["labels"][scored], scored.nonzero()[:, 0]

    def loss(self, model, batch):
        """LM loss on the answer tokens only (the prompt's tokens are labelled -100)."""
        logits, targets, _ = self._answer(model, batch)
        return F.cross_entropy(logits.float(), targets)

    def item_scores(self, model, batch):
        """Each prompt: its key exactly right (1) or not, and its answer tokens' mean cross-entropy."""
        logits, targets, rows = self._answer(model, batch)
        n = len(batch["labels"])
        hit = (logits.argmax(-1) == targets).float()
        per_row = torch.zeros(n).index_add_(0, rows, torch.ones_like(hit))
        hits = torch.zeros(n).index_add_(0, rows, hit)
        losses = torch.zeros(n).index_add_(0, rows, F.cross_entropy(logits.float(), targets, reduction="none"))
        return {"correct": (hits == per_row).float(), "token_accuracy": hits / per_row, "loss": losses / per_row}

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        correct, seen = defaultdict(float), defaultdict(int)
        loss = tokens = 0.0
        for batch in self.test_batches(batch_size, max_batches):
            scores = self.item_scores(model, batch)
            loss += float(scores["loss"].sum())
            tokens += float(scores["token_accuracy"].sum())
            for length, hit in zip(batch["length"].tolist(), scores["correct"].tolist()):
                seen[length] += 1
                correct[length] += hit
        total = sum(seen.values())
        metrics = {"accuracy": sum(correct.values()) / total, "token-accuracy": tokens / total, "loss": loss / total,
                   "num-examples": total}
        metrics.update({f"accuracy-{length}": correct[length] / seen[length] for length in sorted(seen)})
        return metrics
