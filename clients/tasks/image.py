"""Image classification on the embedded CIFAR-10 / Fashion-MNIST (``clients.tasks.vision``)."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from clients.partition import partition_for, train_test_split
from clients.tasks import vision
from clients.tasks.base import Task


@functools.lru_cache(maxsize=2)
def _arrays(name: str):
    return vision.load_arrays(name)


class ImageTask(Task):
    metric = "accuracy"
    higher_is_better = True

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer=None) -> None:
        task = cfg.task
        images, labels, self.class_names = _arrays(str(task.dataset))
        cap = task.get("max_examples")
        pool = np.arange(len(labels))
        if cap and len(pool) > int(cap):
            pool = np.sort(np.random.default_rng(int(cfg.seed)).choice(len(pool), int(cap), replace=False))
        mine = pool[partition_for(cfg, labels[pool], num_partitions=num_partitions, partition_id=partition_id)]
        train, test = train_test_split(mine, float(task.test_fraction), seed=int(cfg.seed) + partition_id)
        self.images, self.labels = images, labels
        self.image_size = int(task.image_size)
        self.num_classes = len(self.class_names)
        if int(task.num_classes) != self.num_classes:
            raise ValueError(f"task.num_classes={task.num_classes} but {task.dataset} has {self.num_classes} classes")
        super().__init__(train, test)

    def label_histogram(self) -> list[int]:
        return np.bincount(self.labels[self.train_idx], minlength=self.num_classes).tolist()

    def collate(self, indices):
        x = vision.to_tensor(self.images[indices], self.image_size, vision.IMAGENET_MEAN, vision.IMAGENET_STD,
                             channels=3)
        return {"x": x, "y": torch.as_tensor(self.labels[indices], dtype=torch.long)}

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        correct, total, loss = 0, 0, 0.0
        for batch in self.test_batches(batch_size, max_batches):
            logits = model(batch["x"])
            correct += int((logits.argmax(-1) == batch["y"]).sum())
            loss += F.cross_entropy(logits, batch["y"], reduction="sum").item()
            total += len(batch["y"])
        return {"accuracy": correct / total, "loss": loss / total, "num-examples": total}
