"""The passkey task's client side (``task=passkey``): teacher-forced scoring and the Task (torch).

The prompts, splits and settings are in :mod:`clients.tasks.passkey` (no torch: composing a config
checks them); this module scores an answer and gives a client its prompts as batches.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

from clients.tasks.base import Task
from clients.tasks.passkey import split_example, task_settings


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
