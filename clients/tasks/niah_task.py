"""The 7-client needle-in-a-haystack task (``task=niah``) for federated runs.

Examples come from :mod:`clients.tasks.niah` (seven templates, four needles at depths
0.1/0.3/0.5/0.7, four choices with hard negatives, Shakespeare filler). A client's data:

* ``natural`` split (the default): one template per client, as in FedNL's Table 2
  (templates are grouped round-robin when there are fewer than seven clients);
  ``iid``/``dirichlet`` split a pool of all templates by template label.
* a training split of ``train_per_template`` examples per template, lengths cycling
  through ``train_lengths``; a test split of ``test_per_template`` per template balanced
  over ``test_lengths`` (the paper: 15 over 1K/2K/4K); optionally a long split of
  ``long_per_template`` per template over ``long_lengths`` (8K/16K).
  Train, test and long splits use different seeds (derived from ``cfg.seed``), so no
  test haystack is a training one; everything is reproducible from the seed.

Examples are made lazily and kept per process (a 4K-token example takes about half a
second to assemble). Prompts end with ``Question: …\\nA. …\\nD. …\\nAnswer:``, so the
task shares :class:`~clients.tasks.text.MMLUTask`'s letter scoring: training puts the
loss on the answer letter (full vocabulary), evaluation compares the four letter logits.
Metrics: ``accuracy`` and ``loss`` over the test split, ``accuracy-<L>`` per length, and
``accuracy-long`` / ``accuracy-<L>`` for the long split when it is on.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

from clients.partition import partition_for
from clients.tasks.base import Task, TaskError
from clients.tasks.niah import TEMPLATES, split_example
from clients.tasks.text import LETTERS, MMLUTask, letter_token_ids, special_affixes

# seed offsets of the three splits (examples are seeded by (template, seed, index))
SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "long": 2_000_003}


def _lengths(value, key: str) -> tuple[int, ...]:
    lengths = tuple(int(v) for v in (value or ()))
    if not lengths or any(v <= 0 for v in lengths):
        raise TaskError(f"task.{key} must list positive token lengths, got {value!r}")
    return lengths


class NIAHTask(MMLUTask):
    """One client's NIAH data; scoring as :class:`MMLUTask` (only the data differ)."""

    metric = "accuracy"
    higher_is_better = True

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer) -> None:
        if tokenizer is None:
            raise TaskError(f"task 'niah' needs a causal LM with a tokenizer; model '{cfg.model.name}' has none")
        task = cfg.task
        templates = [str(t) for t in task.templates]
        unknown = sorted(set(templates) - set(TEMPLATES))
        if unknown or not templates or len(set(templates)) != len(templates):
            raise TaskError(f"task.templates must be distinct names from {TEMPLATES}, got {templates}")
        self.lengths = {
            "train": _lengths(task.train_lengths, "train_lengths"),
            "test": _lengths(task.test_lengths, "test_lengths"),
            "long": _lengths(task.long_lengths, "long_lengths") if int(task.get("long_per_template", 0)) else (),
        }
        counts = {
            "train": int(task.train_per_template),
            "test": int(task.test_per_template),
            "long": int(task.get("long_per_template", 0) or 0),
        }
        if counts["train"] <= 0 or counts["test"] <= 0 or counts["long"] < 0:
            raise TaskError(f"task.train_per_template and test_per_template must be > 0, got {counts}")
        self.seed = int(cfg.seed)
        self.tokenizer = tokenizer
        self.letter_ids = torch.tensor(letter_token_ids(tokenizer))
        self.prefix = special_affixes(tokenizer)[0]  # a BOS, for tokenizers that add one

        # Pools of (split, template, index); test/long pools interleave templates so a
        # client that evaluates only its first batches still sees every template and length.
        self.entries: list[tuple[str, str, int]] = []  # (split, template, pool index); Task.items scores
        mine: dict[str, np.ndarray] = {}
        for split, n in counts.items():
            if n == 0:
                mine[split] = np.zeros(0, dtype=np.int64)
                continue
            if split == "train":
                pool = [(split, t, i) for t in templates for i in range(n)]
            else:
                pool = [(split, t, i) for i in range(n) for t in templates]
            chosen = partition_for(cfg, [t for _, t, _ in pool], num_partitions=num_partitions,
                                   partition_id=partition_id, natural_order=templates, seed=self.seed)
            offset = len(self.entries)
            self.entries.extend(pool[int(i)] for i in sorted(chosen))
            mine[split] = np.arange(offset, len(self.entries))
        self.templates = sorted({t for _, t, _ in self.entries})
        self.long_idx = mine["long"]
        self._cache: dict[int, tuple[list[int], int, int]] = {}
        Task.__init__(self, mine["train"], mine["test"])
        self._check_lengths()

    def _check_lengths(self) -> None:
        """Fail at setup, not mid-round, when a length is too short for one of this client's
        templates (the first example of each template at each split's shortest length)."""
        first: dict[tuple[str, str], int] = {}
        for index, (split, template, i) in enumerate(self.entries):
            length = self.lengths[split][i % len(self.lengths[split])]
            if length == min(self.lengths[split]) and (split, template) not in first:
                first[(split, template)] = index
        for (split, template), index in first.items():
            try:
                self._encoded(index)
            except ValueError as err:
                raise TaskError(f"task.{split}_lengths: {err}") from None

    # ------------------------------------------------------------------ data
    def example(self, index: int) -> dict:
        """The generator's dict (prompt, choices, needles, depths, ...) of item ``index``."""
        split, template, i = self.entries[int(index)]
        return split_example(template, i, self.lengths[split], self.seed + SPLIT_SEEDS[split], self.tokenizer)

    def length_of(self, index: int) -> int:
        """Target length (tokens) of item ``index``, without making the example."""
        split, _, i = self.entries[int(index)]
        return self.lengths[split][i % len(self.lengths[split])]

    def _encoded(self, index: int) -> tuple[list[int], int, int]:
        """(prompt token ids, answer index, target length) of item ``index``, cached."""
        index = int(index)
        if index not in self._cache:
            ex = self.example(index)
            ids = self.prefix + self.tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
            self._cache[index] = (ids, LETTERS.index(ex["answer_letter"]), int(ex["length_tokens"]))
        return self._cache[index]

    def collate(self, indices):
        """Right-padded prompts; ``last`` = index of each prompt's last token ("Answer:")."""
        encoded = [self._encoded(i) for i in indices]
        width = max(len(ids) for ids, _, _ in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attention = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, (ids, _, _) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention,
            "last": torch.tensor([len(ids) - 1 for ids, _, _ in encoded]),
            "answer": torch.tensor([answer for _, answer, _ in encoded]),
            "length": torch.tensor([length for _, _, length in encoded]),
        }

    # ------------------------------------------------------------------ evaluation
    def _score(self, model, indices: np.ndarray, batch_size: int, max_batches: int):
        n = len(indices) if max_batches <= 0 else min(len(indices), batch_size * max_batches)
        correct, loss = defaultdict(int), 0.0
        seen = defaultdict(int)
        for start in range(0, n, batch_size):
            batch = self.collate(indices[start : min(n, start + batch_size)])
            _, four = self._letter_logits(model, batch)
            hits = (four.argmax(-1) == batch["answer"]).tolist()
            loss += F.cross_entropy(four.float(), batch["answer"], reduction="sum").item()
            for length, hit in zip(batch["length"].tolist(), hits):
                seen[length] += 1
                correct[length] += int(hit)
        return correct, seen, loss

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        correct, seen, loss = self._score(model, self.test_idx, batch_size, max_batches)
        total = sum(seen.values())
        metrics = {"accuracy": sum(correct.values()) / total, "loss": loss / total, "num-examples": total}
        metrics.update({f"accuracy-{length}": correct[length] / seen[length] for length in sorted(seen)})
        if len(self.long_idx):
            correct, seen, _ = self._score(model, self.long_idx, batch_size, max_batches)
            metrics["accuracy-long"] = sum(correct.values()) / sum(seen.values())
            metrics.update({f"accuracy-{length}": correct[length] / seen[length] for length in sorted(seen)})
        return metrics
