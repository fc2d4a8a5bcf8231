"""Image classification on the embedded CIFAR-10 / Fashion-MNIST (``clients.tasks.vision``)."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from clients.partition import PartitionError, held_out_split, partition_for, public_split, train_test_split
from clients.tasks import vision
from clients.tasks.base import Task


@functools.lru_cache(maxsize=2)
def _arrays(name: str):
    return vision.load_arrays(name)


@functools.lru_cache(maxsize=4)
def _public_split(name: str, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(public split, the clients' pool) of a dataset: once per process, not once per client (10 ms each)."""
    return public_split(_arrays(name)[1], fraction, seed=seed)


class ImageTask(Task):
    metric = "accuracy"
    higher_is_better = True

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer=None) -> None:
        """Client ``partition_id``'s share of the images outside the public split."""
        _, pool = self._load(cfg)
        cap = cfg.task.get("max_examples")
        if cap and len(pool) > int(cap):
            pool = np.sort(np.random.default_rng(int(cfg.seed)).choice(pool, int(cap), replace=False))
        mine = pool[partition_for(cfg, self.labels[pool], num_partitions=num_partitions, partition_id=partition_id)]
        train, test = held_out_split(mine, cfg.task, seed=int(cfg.seed) + partition_id)
        super().__init__(train, test)

    @classmethod
    def public(cls, cfg, holdout: float = 0.1) -> "ImageTask":
        """The server's view: the public split (``task.public_fraction`` of every class, never
        a client's), ``holdout`` of it kept aside to report the pretraining's accuracy."""
        task = cls.__new__(cls)
        public, _ = task._load(cfg)
        if len(public) < 2:
            raise PartitionError(f"task {cfg.task.name} has no public split: set task.public_fraction (e.g. 0.2)")
        train, test = train_test_split(public, holdout, seed=int(cfg.task.get("public_seed", 0)))
        Task.__init__(task, train, test)
        return task

    def _load(self, cfg) -> tuple[np.ndarray, np.ndarray]:
        """Read the dataset; return (public split, the clients' pool): disjoint, together everything."""
        task = cfg.task
        self.images, self.labels, self.class_names = _arrays(str(task.dataset))
        self.image_size = int(task.image_size)
        self.num_classes = len(self.class_names)
        if int(task.num_classes) != self.num_classes:
            raise ValueError(f"task.num_classes={task.num_classes} but {task.dataset} has {self.num_classes} classes")
        return _public_split(str(task.dataset), float(task.get("public_fraction", 0.0) or 0.0),
                             int(task.get("public_seed", 0)))

    def label_histogram(self) -> list[int]:
        return np.bincount(self.labels[self.train_idx], minlength=self.num_classes).tolist()

    def collate(self, indices):
        x = vision.to_tensor(self.images[indices], self.image_size, vision.IMAGENET_MEAN, vision.IMAGENET_STD,
                             channels=3)
        return {"x": x, "y": torch.as_tensor(self.labels[indices], dtype=torch.long)}

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def item_scores(self, model, batch):
        logits = model(batch["x"])
        return {"correct": (logits.argmax(-1) == batch["y"]).float(),
                "loss": F.cross_entropy(logits, batch["y"], reduction="none")}

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        correct, total, loss = 0, 0, 0.0
        for batch in self.test_batches(batch_size, max_batches):
            logits = model(batch["x"])
            correct += int((logits.argmax(-1) == batch["y"]).sum())
            loss += F.cross_entropy(logits, batch["y"], reduction="sum").item()
            total += len(batch["y"])
        return {"accuracy": correct / total, "loss": loss / total, "num-examples": total}
