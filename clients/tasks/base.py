"""What every task gives a client: its partition, batches, a loss and an evaluation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a batch is made or scored, not by composing a config
    import torch


class TaskError(ValueError):
    pass


class Task(ABC):
    """One client's view of a task (its partition, split into train and test)."""

    metric: str = "loss"
    higher_is_better: bool = False

    def __init__(self, train_idx: np.ndarray, test_idx: np.ndarray) -> None:
        if len(train_idx) == 0 or len(test_idx) == 0:
            raise TaskError("a client needs at least one training and one test example")
        self.train_idx = np.asarray(train_idx)
        self.test_idx = np.asarray(test_idx)

    @property
    def num_train(self) -> int:
        return len(self.train_idx)

    @property
    def num_test(self) -> int:
        return len(self.test_idx)

    @abstractmethod
    def collate(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Examples (by index) -> one batch of tensors."""

    @abstractmethod
    def loss(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training objective on one batch (a scalar)."""

    def train_batches(self, steps: int, batch_size: int, rng: np.random.Generator) -> Iterator[dict]:
        """``steps`` batches drawn without replacement within each pass over the data."""
        order = rng.permutation(self.train_idx)
        pos = 0
        for _ in range(steps):
            if pos + batch_size > len(order):
                order, pos = rng.permutation(self.train_idx), 0
            yield self.collate(order[pos : pos + batch_size])
            pos += batch_size

    def test_batches(self, batch_size: int, max_batches: int) -> Iterator[dict]:
        n = len(self.test_idx) if max_batches <= 0 else min(len(self.test_idx), batch_size * max_batches)
        for start in range(0, n, batch_size):
            yield self.collate(self.test_idx[start : min(n, start + batch_size)])

    def item_scores(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per held-out item of ``batch``: ``loss`` (its mean cross-entropy) and, for tasks scored by
        accuracy, ``correct`` (0/1). A task that cannot score items one by one says so."""
        raise TaskError(f"task {type(self).__name__} gives no per-item scores")

    def items(self, model, batch_size: int, max_batches: int) -> dict[str, np.ndarray]:
        """The items :meth:`evaluate` scores, in its order: ``index`` (into the task's examples) and
        :meth:`item_scores` per item (a paired comparison of two models uses the same items)."""
        import torch

        n = len(self.test_idx) if max_batches <= 0 else min(len(self.test_idx), batch_size * max_batches)
        scores: dict[str, list] = {}
        with torch.no_grad():
            for batch in self.test_batches(batch_size, max_batches):
                for key, value in self.item_scores(model, batch).items():
                    scores.setdefault(key, []).append(value.detach().float().cpu().numpy())
        out = {key: np.concatenate(parts) for key, parts in scores.items()}
        out["index"] = np.asarray(self.test_idx[:n], dtype=np.int64)
        return out

    @abstractmethod
    def evaluate(self, model, batch_size: int, max_batches: int) -> dict[str, float | int]:
        """Metrics on the client's test split: ``{metric, 'loss', 'num-examples'}``."""
