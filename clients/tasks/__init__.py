"""Data tasks: ``make_task(cfg, partition_id, num_partitions, tokenizer)`` -> a client's Task."""

from __future__ import annotations

from clients.tasks.base import Task, TaskError


def make_task(cfg, partition_id: int, num_partitions: int, tokenizer=None) -> Task:
    kind = cfg.task.kind
    if kind == "lm":
        from clients.tasks.text import ShakespeareTask

        return ShakespeareTask(cfg, partition_id, num_partitions, tokenizer)
    if kind == "mcq":
        from clients.tasks.text import MMLUTask

        return MMLUTask(cfg, partition_id, num_partitions, tokenizer)
    if kind == "text":
        from clients.tasks.local import LocalTextTask

        return LocalTextTask(cfg, partition_id, num_partitions, tokenizer)
    if kind == "niah":
        from clients.tasks.niah_task import NIAHTask

        return NIAHTask(cfg, partition_id, num_partitions, tokenizer)
    if kind == "passkey":
        from clients.tasks.passkey_task import PasskeyTask

        return PasskeyTask(cfg, partition_id, num_partitions, tokenizer)
    if kind == "image":
        from clients.tasks.image import ImageTask

        return ImageTask(cfg, partition_id, num_partitions)
    raise TaskError(f"unknown task kind '{kind}' (task '{cfg.task.name}')")


__all__ = ["Task", "TaskError", "make_task"]
