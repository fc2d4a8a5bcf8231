"""Your own text, from local files: ``task=text`` (language modelling) and ``task=instructions``
(prompt → response, the prompt masked out of the loss); both are ``kind: text``.

* ``task.path``: a file, a glob, a folder of files (one natural group per file) or a folder written
  by ``datasets``' ``save_to_disk``; relative paths are read from the app's folder (this checkout,
  or its installed copy under ``flwr run``). ``task.format``: ``auto`` (by extension), ``json``
  (JSON Lines too), ``csv``, ``parquet``, ``text`` (one example per ``task.sample_by``: line,
  paragraph or document) or ``disk``. Files are read with ``datasets.load_dataset(<format>,
  data_files=...)`` (offline on local files).
* An example is ``task.text`` (a template over the row's fields, ``"{text}"``), every token in the
  loss; or ``task.prompt`` + ``task.response`` (templates), the loss on the response's tokens only
  (labels -100 over the prompt); ``task.chat=true`` renders them through the tokenizer's chat
  template. Special tokens follow the tokenizer (:func:`clients.tasks.text.special_affixes`): a BOS
  starts every example of a tokenizer that adds one.
* Examples longer than ``task.max_length`` tokens (null = ``train.seq_len``): language modelling
  cuts them into consecutive pieces; instructions keep the response and cut the prompt's start.
* Partitions: ``natural`` by ``task.group`` (a field; null = the file each row came from), ``iid``,
  ``dirichlet`` over ``task.label`` (a field; null = the group); rows, not pieces, are partitioned
  and split into train and held-out (``task.test_fraction`` of each client's rows).
* Metrics: ``perplexity`` (response tokens only, for instructions) and, for instructions,
  ``accuracy``: the fraction of held-out examples whose every response token is the model's
  greedy choice (teacher-forced; a one-word label answer makes it classification accuracy).
"""

from __future__ import annotations

import functools
import glob
import json
import math
import string
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clients.models.llm import decoder_and_head, token_loss
from clients.partition import PartitionError, held_out_split, partition_for
from clients.tasks.base import Task, TaskError
from clients.tasks.text import special_affixes

APP_ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("auto", "json", "csv", "parquet", "text", "disk")
EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
              ".text": "text", ".md": "text"}
SAMPLE_BY = ("line", "paragraph", "document")
METRICS = ("perplexity", "accuracy")


# --------------------------------------------------------------------------- files
def resolve_path(path) -> Path | str:
    """``task.path`` as the files will be looked up: absolute as given, relative from the app's folder
    (a glob stays a pattern)."""
    if not path:
        raise TaskError("task.path is not set: give a file, a glob, a folder of files or a save_to_disk folder")
    text = str(Path(str(path)).expanduser())
    full = text if Path(text).is_absolute() else str(APP_ROOT / text)
    return full if glob.has_magic(full) else Path(full)


def data_files(path, fmt: str) -> tuple[str, list[Path]]:
    """``(format, files)`` of ``task.path``; ``format`` ``disk`` for a save_to_disk folder (one entry)."""
    if fmt not in FORMATS:
        raise TaskError(f"task.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    where = resolve_path(path)
    if isinstance(where, str):
        files = sorted(Path(p) for p in glob.glob(where, recursive=True) if Path(p).is_file())
        if not files:
            raise TaskError(f"task.path '{path}' matches no file (relative paths are read from {APP_ROOT})")
    elif not where.exists():
        raise TaskError(f"task.path '{path}' does not exist (relative paths are read from {APP_ROOT})")
    elif where.is_dir() and ((where / "dataset_info.json").is_file() or (where / "dataset_dict.json").is_file()):
        if fmt not in ("auto", "disk"):
            raise TaskError(f"task.path '{path}' is a save_to_disk folder: use task.format=disk (or auto), not {fmt}")
        return "disk", [where]
    elif where.is_dir():
        files = sorted(p for p in where.iterdir() if p.is_file() and (p.suffix.lower() in EXTENSIONS or fmt != "auto"))
        if not files:
            raise TaskError(f"task.path '{path}' holds no data file ({', '.join(EXTENSIONS)})")
    else:
        files = [where]
    if fmt == "disk":
        raise TaskError(f"task.format=disk reads a save_to_disk folder; task.path '{path}' is not one")
    if fmt == "auto":
        kinds = {EXTENSIONS.get(p.suffix.lower()) for p in files}
        if None in kinds or len(kinds) != 1:
            raise TaskError(f"task.format=auto cannot tell the format of {', '.join(p.name for p in files[:5])}: "
                            f"set task.format to one of {', '.join(FORMATS[1:])}")
        fmt = kinds.pop()
    return fmt, files


@functools.lru_cache(maxsize=8)
def _read(fmt: str, files: tuple[str, ...], sample_by: str, stamp: tuple) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    import datasets

    datasets.disable_progress_bars()
    rows, sources = [], []
    for file in files:
        try:
            if fmt == "disk":
                loaded = datasets.load_from_disk(file)
                parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(Path(file).name, loaded)]
            else:
                extra = {"sample_by": sample_by} if fmt == "text" else {}
                parts = [(Path(file).stem, datasets.load_dataset(fmt, data_files=file, split="train", **extra))]
        except Exception as err:  # noqa: BLE001 - a file datasets cannot read: one line naming it
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TaskError(f"cannot read {file} as {fmt}: {reason}") from None
        for source, table in parts:
            part = table.to_list()
            rows += part
            sources += [source] * len(part)
    return tuple(rows), tuple(sources)


def read_rows(task) -> tuple[list[dict], list[str]]:
    """Every row of ``task.path`` (dicts of its fields) and, per row, its file's name (or split's)."""
    sample_by = str(task.get("sample_by") or "line")
    if sample_by not in SAMPLE_BY:
        raise TaskError(f"task.sample_by must be one of {', '.join(SAMPLE_BY)}, got {sample_by!r}")
    fmt, files = data_files(task.get("path"), str(task.get("format") or "auto"))
    stamp = tuple((str(f), f.stat().st_mtime_ns) for f in files)  # edited files are read again
    rows, sources = _read(fmt, tuple(str(f) for f in files), sample_by, stamp)
    if not rows:
        raise TaskError(f"task.path '{task.path}' holds no rows")
    return list(rows), list(sources)


def template_fields(template: str) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(template) if field]


def templates_of(task) -> dict[str, str]:
    """The task's templates by key: ``prompt`` and ``response`` (instructions) or ``text``."""
    if task.get("prompt") is not None:
        return {"prompt": str(task.get("prompt")), "response": str(task.get("response"))}
    return {"text": str(task.get("text") or "{text}")}


TEMPLATE_KEYS = ("text", "prompt", "response")


def read_template_file(path) -> dict[str, str]:
    """``task.template_file``: a YAML mapping of ``text`` or ``prompt`` and ``response`` to templates, so a
    template with quotes, colons, braces or newlines needs no quoting on the command line."""
    import yaml

    where = resolve_path(path)
    if isinstance(where, str) or not where.is_file():
        raise TaskError(f"task.template_file '{path}' is not a file (relative paths are read from {APP_ROOT})")
    try:
        body = yaml.safe_load(where.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise TaskError(f"task.template_file {where} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(body, dict) or not body or set(body) - set(TEMPLATE_KEYS) or \
            not all(isinstance(v, str) for v in body.values()):
        raise TaskError(f"task.template_file {where} must map text, or prompt and response, to template strings "
                        f"(e.g. prompt: \"Q: {{question}}\\n\"), got {body!r:.120}")
    return body


# --------------------------------------------------------------------------- checks before a run
def scan_file(fmt: str, path: Path) -> None:
    """What ``datasets`` reports late and badly, found in one pass over a text-based file: an empty file,
    bytes that are not UTF-8, a JSON line that does not parse or is not an object; a TaskError naming
    the file, the line and the fix."""
    if fmt not in ("json", "csv", "text"):
        return
    data = path.read_bytes()
    if not data.strip():
        raise TaskError(f"{path} is empty: give it rows, or point task.path elsewhere")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise TaskError(f"{path}, line {line}: not UTF-8 (byte 0x{data[err.start]:02x}); re-save the file as "
                        f"UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}`") from None
    if fmt != "json":
        return
    if text.lstrip().startswith("["):  # one JSON array
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}, line {number}: not valid JSON ({err.msg}, column {err.colno}); fix or "
                            "delete that line (JSON Lines: one object per line)") from None
        if not isinstance(value, dict):
            raise TaskError(f"{path}, line {number}: a JSON {type(value).__name__}, not an object with fields "
                            "(JSON Lines: one object per line)")


def check_data(cfg) -> None:
    """The data a ``kind: text`` run will read, checked once where the run is composed, so a bad file is
    refused in one line before anything starts: syntax and encoding (:func:`scan_file`), every field the
    templates, ``task.group`` and ``task.label`` name present in every row, and every client's share
    (partition, held-out split) possible. Raises TaskError naming the file, the row and the fix."""
    task = cfg.task
    fmt, files = data_files(task.get("path"), str(task.get("format") or "auto"))
    for path in files:
        scan_file(fmt, path)
    rows, sources = read_rows(task)
    line = {}  # a row's number within its file (1-based), for messages
    seen: dict[str, int] = {}
    for i, source in enumerate(sources):
        seen[source] = line[i] = seen.get(source, 0) + 1
    fields = sorted(rows[0])
    needed = [(f"task.{key}", field) for key, template in templates_of(task).items() for field in
              template_fields(template)]
    needed += [(f"task.{key}", task.get(key)) for key in ("group", "label") if task.get(key)]
    for key, field in needed:
        if field not in rows[0]:
            raise TaskError(f"{key} names field '{field}', which the rows of {task.path} lack; their fields: "
                            f"{', '.join(fields)}")
        for i, row in enumerate(rows):
            if row.get(field) is None:
                where = next((str(f) for f in files if f.stem == sources[i]), sources[i])
                raise TaskError(f"{where}, row {line[i]}: field '{field}' is missing or null ({key} needs it); "
                                "fill it in or drop the row")
    clients = int(cfg.get("num_clients") or task.default_clients)
    for partition_id in range(clients):
        client_rows(cfg, rows, sources, partition_id, clients)


def client_rows(cfg, rows, sources, partition_id: int, num_partitions: int):
    """One client's rows of ``rows``: ``(train, held-out, groups)`` — its training and held-out row
    indices and the natural groups its rows come from (``task.group``'s values, or file names)."""
    task = cfg.task
    fields = sorted(rows[0])
    groups = LocalTextTask._column(rows, sources, task.get("group"), "group", fields)
    labels = LocalTextTask._column(rows, sources, task.get("label"), "label", fields) if task.get("label") else groups
    cap = task.get("max_examples")
    keep = np.arange(len(rows))
    if cap and len(rows) > int(cap):
        keep = np.sort(np.random.default_rng(int(cfg.seed)).choice(len(rows), int(cap), replace=False))
    by = labels if str(cfg.partition.name) == "dirichlet" else groups
    part = [by[i] for i in keep]
    try:
        mine = keep[partition_for(cfg, part, num_partitions=num_partitions, partition_id=partition_id,
                                  natural_order=list(dict.fromkeys(part)))]
        train_rows, test_rows = held_out_split(mine, task, seed=int(cfg.seed) + partition_id)
    except (PartitionError, TaskError) as err:
        raise TaskError(f"task '{task.name}', client {partition_id} of {num_partitions} "
                        f"(partition={cfg.partition.name}): {err}") from None
    return train_rows, test_rows, sorted({groups[i] for i in mine})


# --------------------------------------------------------------------------- the task
class LocalTextTask(Task):
    """One client's share of a local text dataset (module docstring)."""

    def __init__(self, cfg, partition_id: int, num_partitions: int, tokenizer) -> None:
        if tokenizer is None:
            raise TaskError(f"task '{cfg.task.name}' needs a causal LM with a tokenizer")
        task = cfg.task
        self.metric = str(task.metric)
        self.higher_is_better = self.metric == "accuracy"
        self.instructions = task.get("prompt") is not None
        self.chat = bool(task.get("chat", False))
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise TaskError(f"task.chat=true, but the tokenizer of model '{cfg.model.name}' has no chat template")
        self.tokenizer = tokenizer
        self.path = task.get("path")
        self.logit_chunk = int(cfg.train.get("logit_chunk", 256) or 0)
        self.max_length = int(task.get("max_length") or cfg.train.seq_len) + 1  # tokens in, labels shifted by one
        rows, sources = read_rows(task)
        fields = sorted(rows[0])
        templates = templates_of(task)
        for key, template in templates.items():
            for field in template_fields(template):
                if field not in rows[0]:
                    raise TaskError(f"task.{key} names field '{field}', which the rows of {task.path} lack; their "
                                    f"fields: {', '.join(fields)}")
        train_rows, test_rows, self.groups = client_rows(cfg, rows, sources, partition_id, num_partitions)
        self.examples: list[tuple[torch.Tensor, int]] = []  # (token ids, tokens masked out of the loss)
        train = self._encode(rows, train_rows, templates)
        test = self._encode(rows, test_rows, templates)
        if not len(train) or not len(test):
            raise TaskError(f"task '{task.name}', client {partition_id}: its rows make no example of 2+ tokens "
                            "(empty texts?)")
        super().__init__(train, test)

    @staticmethod
    def _column(rows, sources, field, key: str, fields) -> list[str]:
        if not field:
            return list(sources)
        if field not in rows[0]:
            raise TaskError(f"task.{key} names field '{field}', which the rows lack; their fields: {', '.join(fields)}")
        return [str(row.get(field)) for row in rows]

    def _render(self, row: dict, templates: dict) -> dict[str, str]:
        for key, template in templates.items():
            for field in template_fields(template):
                if row.get(field) is None:  # an empty example would train on nothing, silently
                    raise TaskError(f"a row of {self.path} has no value for field '{field}' (task.{key} needs it); "
                                    "fill it in or drop the row")
        values = {key: template.format(**row) for key, template in templates.items()}
        if self.instructions and self.chat:
            user = [{"role": "user", "content": values["prompt"]}]
            prompt = self.tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = self.tokenizer.apply_chat_template(user + [{"role": "assistant", "content": values["response"]}],
                                                      tokenize=False)
            if not full.startswith(prompt):
                raise TaskError("the tokenizer's chat template does not render the prompt as the start of the "
                                "conversation; use task.chat=false")
            values = {"prompt": prompt, "response": full[len(prompt):]}
        return values

    def _encode(self, rows, indices, templates) -> np.ndarray:
        """Tokenise rows ``indices`` into examples; their positions in :attr:`examples`."""
        encode = lambda text: list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        prefix, suffix = special_affixes(self.tokenizer)
        if self.instructions and self.chat:
            prefix = []  # a chat template writes its own start tokens
        start = len(self.examples)
        for i in indices:
            values = self._render(rows[int(i)], templates)
            if self.instructions:
                prompt, response = prefix + encode(values["prompt"]), encode(values["response"]) + suffix
                response = response[: self.max_length - 1]
                prompt = prompt[-(self.max_length - len(response)):] if len(prompt) + len(response) > self.max_length \
                    else prompt
                ids, masked = prompt + response, len(prompt)
                if len(ids) >= 2 and response:
                    self.examples.append((torch.tensor(ids, dtype=torch.long), masked))
            else:
                ids = encode(values["text"]) + suffix
                piece = self.max_length - len(prefix)
                for at in range(0, len(ids), piece):
                    chunk = prefix + ids[at : at + piece]
                    if len(chunk) >= 2:
                        self.examples.append((torch.tensor(chunk, dtype=torch.long), 0))
        return np.arange(start, len(self.examples))

    # ----------------------------------------------------------------------- batches, loss, metrics
    def collate(self, indices):
        """Right-padded ``input_ids`` and next-token ``labels``, -100 over padding and the prompt."""
        chosen = [self.examples[int(i)] for i in indices]
        width = max(len(ids) for ids, _ in chosen) - 1
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(chosen), width), pad, dtype=torch.long)
        labels = torch.full((len(chosen), width), -100, dtype=torch.long)
        for row, (ids, masked) in enumerate(chosen):
            n = len(ids) - 1
            input_ids[row, :n] = ids[:-1]
            labels[row, :n] = ids[1:]
            labels[row, : max(0, masked - 1)] = -100  # targets that are prompt tokens
        return {"input_ids": input_ids, "labels": labels}

    def loss(self, model, batch):
        return token_loss(model, batch["input_ids"], batch["labels"], chunk_tokens=self.logit_chunk)

    @torch.no_grad()
    def _scores(self, model, batch) -> dict[str, torch.Tensor]:
        """Per example: summed cross-entropy and count of its scored tokens, and whether the greedy
        choice is right at every one of them; the output layer runs on scored positions only."""
        labels = batch["labels"]
        scored = labels != -100
        rows = scored.nonzero()[:, 0]
        decoder, head = decoder_and_head(model)
        if decoder is None:
            logits_at = model(input_ids=batch["input_ids"]).logits[scored]
            parts = [logits_at]
        else:
            hidden = decoder(input_ids=batch["input_ids"]).last_hidden_state[scored]
            step = self.logit_chunk or len(hidden)
            parts = [head(hidden[at : at + step]) for at in range(0, len(hidden), max(1, step))]
        targets = labels[scored]
        losses, right, at = [], [], 0
        for logits in parts:
            part = targets[at : at + len(logits)]
            losses.append(F.cross_entropy(logits.float(), part, reduction="none"))
            right.append(logits.argmax(-1) == part)
            at += len(logits)
        n = len(labels)
        loss_sum = torch.zeros(n, device=labels.device).index_add_(0, rows, torch.cat(losses))
        count = scored.sum(dim=1)
        wrong = torch.zeros(n, device=labels.device).index_add_(0, rows, (~torch.cat(right)).float())
        return {"loss_sum": loss_sum, "count": count, "correct": (wrong == 0).float()}

    def item_scores(self, model, batch):
        scores = self._scores(model, batch)
        out = {"loss": scores["loss_sum"] / scores["count"].clamp(min=1)}
        if self.instructions:
            out["correct"] = scores["correct"]
        return out

    @torch.no_grad()
    def evaluate(self, model, batch_size, max_batches):
        total, tokens, correct, examples = 0.0, 0, 0.0, 0
        for batch in self.test_batches(batch_size, max_batches):
            scores = self._scores(model, batch)
            total += float(scores["loss_sum"].sum())
            tokens += int(scores["count"].sum())
            correct += float(scores["correct"].sum())
            examples += len(batch["labels"])
        loss = total / max(1, tokens)
        out = {"perplexity": math.exp(min(loss, 50.0)), "loss": loss, "num-examples": examples}
        if self.instructions:
            out["accuracy"] = correct / max(1, examples)
        return out
