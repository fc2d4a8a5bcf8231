"""Local datasets (task=text, task=instructions; clients/tasks/local.py): formats, masking, partitions,
errors, and every method's round on them (the tiny random-init Llama, in process)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_tasks import word_tokenizer

from clients.tasks import make_task
from clients.tasks.base import TaskError
from clients.tasks.local import read_rows
from fedapps.config import ConfigError, compose

torch.set_num_threads(1)

ROWS = [{"id": i, "author": ["ann", "bob", "cy"][i % 3], "mood": ["up", "down"][i % 2],
         "question": f"the of {i} and to", "answer": "A" if i % 2 else "B",
         "text": " ".join(["the", "of", "and", "to", "I", "you"][(i + k) % 6] for k in range(4 + i % 5))}
        for i in range(60)]


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()  # adds a BOS, as Gemma's does


@pytest.fixture(scope="module")
def smol():
    from clients.models.llm import causal_lm_config

    return causal_lm_config(compose(preset="test").model)[1]


def jsonl(folder, rows=ROWS, name="data.jsonl"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg_for(path, *more, task="text"):
    group = [] if any(m.startswith("task.group=") for m in more) else ["task.group=null"]  # ROWS have no genre
    # one client unless told: compose checks every client's share (#60) and these tests make clients of their own
    clients = [] if any(m.startswith("num_clients=") for m in more) else ["num_clients=1"]
    return compose([f"task.path={path}", *group, *clients, *more], task=task, preset="test")


# --------------------------------------------------------------------------- formats
def test_every_format_reads_the_same_rows(tmp_path):
    from datasets import Dataset

    table = Dataset.from_list(ROWS)
    paths = {"json": jsonl(tmp_path / "j")}
    (tmp_path / "c").mkdir()
    table.to_csv(str(tmp_path / "c" / "data.csv"), index=False)
    paths["csv"] = tmp_path / "c" / "data.csv"
    table.to_parquet(str(tmp_path / "data.parquet"))
    paths["parquet"] = tmp_path / "data.parquet"
    table.save_to_disk(str(tmp_path / "saved"))
    paths["disk"] = tmp_path / "saved"
    for fmt, path in paths.items():
        rows, sources = read_rows(cfg_for(path).task)
        assert [r["text"] for r in rows] == [r["text"] for r in ROWS], fmt
        assert [r["author"] for r in rows] == [r["author"] for r in ROWS], fmt
    # a folder of files (a glob too): each file is a natural group
    for author in ("ann", "bob", "cy"):
        jsonl(tmp_path / "by-file", [r for r in ROWS if r["author"] == author], f"{author}.jsonl")
    for path in (tmp_path / "by-file", tmp_path / "by-file" / "*.jsonl"):
        rows, sources = read_rows(cfg_for(path).task)
        assert len(rows) == 60 and sorted(set(sources)) == ["ann", "bob", "cy"]
    # plain text: one example per line (or paragraph)
    (tmp_path / "t.txt").write_text("first line of the\nsecond line\n\nthird one\n")
    assert [r["text"] for r in read_rows(cfg_for(tmp_path / "t.txt").task)[0]] == \
        ["first line of the", "second line", "", "third one"]
    paragraphs = read_rows(cfg_for(tmp_path / "t.txt", "task.sample_by=paragraph").task)[0]
    assert [r["text"].strip() for r in paragraphs] == ["first line of the\nsecond line", "third one"]


def test_the_worked_example_ships_with_the_app_and_runs_from_its_relative_path(smol):
    cfg = compose(task="instructions", preset="test")
    rows, _ = read_rows(cfg.task)
    assert len(rows) == 1200 and {r["genre"] for r in rows} == {"tragedy", "comedy", "history", "romance"}
    task = make_task(cfg, 0, 2, smol)
    assert task.groups == ["history", "tragedy"] and task.metric == "accuracy" and task.higher_is_better


# --------------------------------------------------------------------------- examples and masking
def test_language_modelling_puts_every_token_in_the_loss_with_a_bos_per_piece(tmp_path, tok):
    long = {"id": 99, "author": "ann", "mood": "up", "question": "", "answer": "", "text": "the of and " * 20}
    path = jsonl(tmp_path, ROWS + [long])
    task = make_task(cfg_for(path, "task.group=author", "task.max_length=16", "partition=iid"), 0, 1, tok)
    lengths = sorted(len(ids) for ids, _ in task.examples)
    assert lengths[-1] == 17 and all(masked == 0 for _, masked in task.examples)  # the long row: pieces of 16 + BOS
    assert all(int(ids[0]) == tok.bos_token_id for ids, _ in task.examples)
    batch = task.collate(np.arange(len(task.examples))[:8])
    assert not bool((batch["labels"] == tok.bos_token_id).any())
    real = batch["labels"] != -100  # padding only
    assert bool((batch["input_ids"][:, 1:][real[:, 1:]] == batch["labels"][:, :-1][real[:, 1:]]).all())


def test_instructions_mask_the_prompt_out_of_the_loss(tmp_path, tok):
    from clients.models.llm import load_causal_lm

    path = jsonl(tmp_path)
    cfg = cfg_for(path, "task.group=author", "task.prompt='Question: {question} ?'", "task.response=' {answer}'",
                  task="instructions")
    task = make_task(cfg, 0, 3, tok)
    batch = task.collate(task.train_idx[:4])
    for row, index in enumerate(task.train_idx[:4]):
        ids, masked = task.examples[int(index)]
        scored = batch["labels"][row][batch["labels"][row] != -100]
        assert tok.decode(scored) == tok.decode(ids[masked:])  # the response only
        assert tok.convert_ids_to_tokens(ids[:masked].tolist())[:2] == ["<s>", "Question"]
        assert tok.convert_ids_to_tokens(ids[masked:].tolist()) in (["A"], ["B"])
    # the loss is the response tokens' mean cross-entropy, with or without the chunked output layer
    model, _ = load_causal_lm(compose(preset="test").model, seed=0)
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        keep = batch["labels"] != -100
        expected = torch.nn.functional.cross_entropy(logits[keep], batch["labels"][keep])
        assert torch.allclose(task.loss(model, batch), expected, atol=1e-5)
        task.logit_chunk = 0
        assert torch.allclose(task.loss(model, batch), expected, atol=1e-5)
        metrics = task.evaluate(model, 8, 0)
    assert metrics["num-examples"] == task.num_test and 0 <= metrics["accuracy"] <= 1
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))


def test_chat_template_renders_prompt_and_response(tmp_path, smol):
    if not getattr(smol, "chat_template", None):
        pytest.skip("the embedded tokenizer has no chat template")
    cfg = cfg_for(jsonl(tmp_path), "task.group=author", "task.prompt='{question}'", "task.response='{answer}'",
                  "task.chat=true", "task.max_length=64", task="instructions")
    task = make_task(cfg, 0, 3, smol)
    ids, masked = task.examples[int(task.train_idx[0])]
    assert "<|im_start|>assistant" in smol.decode(ids[:masked]) and smol.decode(ids[masked:])[:1] in ("A", "B")


# --------------------------------------------------------------------------- partitions
def test_partitions_natural_by_field_or_file_iid_and_dirichlet(tmp_path, tok):
    path = jsonl(tmp_path / "one")
    natural = [make_task(cfg_for(path, "task.group=author"), i, 3, tok) for i in range(3)]
    assert [t.groups for t in natural] == [["ann"], ["bob"], ["cy"]]
    for t in natural:
        assert not set(t.train_idx.tolist()) & set(t.test_idx.tolist())
    for author in ("ann", "bob", "cy"):
        jsonl(tmp_path / "files", [r for r in ROWS if r["author"] == author], f"{author}.jsonl")
    by_file = [make_task(cfg_for(tmp_path / "files", "task.group=null"), i, 2, tok) for i in range(2)]
    assert [t.groups for t in by_file] == [["ann", "cy"], ["bob"]]
    iid = [make_task(cfg_for(path, "partition=iid"), i, 3, tok) for i in range(3)]
    assert [t.num_train + t.num_test for t in iid] == [20, 20, 20]
    assert len({g for t in iid for g in t.groups}) == 1  # genre-less rows: one group (their file)
    dirichlet = [make_task(cfg_for(path, "partition=dirichlet", "partition.alpha=0.5", "partition.min_partition_size=2",
                                   "task.label=mood"), i, 2, tok) for i in range(2)]
    assert sum(t.num_train + t.num_test for t in dirichlet) == 60


# --------------------------------------------------------------------------- errors: one line each
def test_errors_are_one_line_and_name_the_fix(tmp_path, tok):
    with pytest.raises(ConfigError, match=r"task.path '/no/such.jsonl' does not exist"):
        cfg_for("/no/such.jsonl")
    with pytest.raises(ConfigError, match="matches no file"):
        cfg_for(tmp_path / "*.csv")
    with pytest.raises(ConfigError, match="needs a causal LM"):
        compose(task="text", model="tiny-cnn")
    with pytest.raises(ConfigError, match="both task.prompt and task.response"):
        cfg_for(jsonl(tmp_path), "task.prompt='{question}'")
    with pytest.raises(ConfigError, match="task.metric=accuracy scores responses"):
        cfg_for(jsonl(tmp_path), "task.metric=accuracy")
    (tmp_path / "notes.xyz").write_text("x")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        cfg_for(tmp_path / "notes.xyz")
    path = jsonl(tmp_path)
    cases = {"task.text='{body}'": "task.text names field 'body'.*their fields: answer, author, id, mood",
             "task.group=writer": "task.group names field 'writer'",
             "task.label=tone": "task.label names field 'tone'"}
    for override, message in cases.items():  # refused where the run is composed (#60: once by each client)
        with pytest.raises(ConfigError, match=message) as err:
            cfg_for(path, override, "partition=dirichlet" if "label" in override else "partition=natural")
        assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match=r"client 3 of 4 \(partition=natural\): the natural split has 3 groups") as err:
        make_task(cfg_for(path, "task.group=author"), 3, 4, tok)
    assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match=r"client 1 of 2 \(partition=natural\): a client got 1 example"):
        make_task(cfg_for(jsonl(tmp_path / "two", ROWS[:3]), "task.group=author"), 1, 2, tok)



# --------------------------------------------------------------------------- #60: data refused where the run is composed
def test_bad_data_is_refused_when_composed_naming_file_row_and_fix(tmp_path):
    """Once each of these failed on the clients a minute later in hundreds of lines (and a row missing its
    field silently became an empty example): now compose refuses it in one line naming file, row and fix."""
    cases = {
        "bad.jsonl": ('{"text": "a b"}\n{not json\n', r"bad.jsonl, line 2: not valid JSON .*fix or delete that line"),
        "list.jsonl": ('{"text": "a b"}\n[1, 2]\n', r"list.jsonl, line 2: a JSON list, not an object"),
        "empty.jsonl": ("\n\n", r"empty.jsonl is empty"),
        "latin.jsonl": ('{"text": "caf\u00e9"}\n'.encode("latin-1"), r"latin.jsonl, line 1: not UTF-8 \(byte 0xe9\); "
                                                                   r"re-save the file as UTF-8, e.g. `iconv"),
        "hole.jsonl": ('{"text": "a b", "author": "x"}\n{"author": "y"}\n', r"hole.jsonl, row 2: field 'text' is "
                                                                           r"missing or null \(task.text needs it\)"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ConfigError, match=message) as err:
            cfg_for(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    path = jsonl(tmp_path / "ok")
    with pytest.raises(ConfigError, match="task.group names field 'genre', which the rows of .* lack"):
        cfg_for(path, "task.group=genre")
    with pytest.raises(ConfigError, match=r"client 0 of 4 \(partition=natural\): the natural split has 3 groups "
                                          r".*use fewer clients or partition=iid/dirichlet"):
        cfg_for(path, "task.group=author", "num_clients=4")
    # instructions: a row without its response field
    rows = [dict(r) for r in ROWS]
    del rows[7]["answer"]
    with pytest.raises(ConfigError, match=r"data.jsonl, row 8: field 'answer' is missing or null \(task.response needs it\)"):
        cfg_for(jsonl(tmp_path / "ins", rows), "task.prompt='{question}'", "task.response=' {answer}'",
                task="instructions")


def test_a_row_without_its_field_never_becomes_an_empty_example(tmp_path, tok):
    """The client's own check (what compose's scan guards): a row missing a template's field raises."""
    cfg = cfg_for(jsonl(tmp_path))
    rows = [dict(r) for r in ROWS]
    rows[0]["text"] = None
    jsonl(tmp_path, rows)
    with pytest.raises(TaskError, match="has no value for field 'text' \\(task.text needs it\\)"):
        make_task(cfg, 0, 1, tok)


def test_a_missing_path_is_refused_before_submitting(tmp_path, capsys):
    from postcard.app_run import ROOT, precheck

    reason = precheck([str(ROOT), "--run-config", f"task='text' overrides='task.path={tmp_path}/none.jsonl'"])
    assert reason == f"task.path '{tmp_path}/none.jsonl' does not exist (relative paths are read from {ROOT})"


# --------------------------------------------------------------------------- every method, one round
@pytest.mark.parametrize("algorithm", ["fedavg-lora", "fednl", "flite", "smartfed"])
def test_every_method_trains_a_round_on_local_instructions(algorithm, tmp_path):
    from inprocess import context, evaluate_round, pool_overrides, train_round

    from fedapps import registry
    from fedapps.config import to_yaml

    overrides = ["train.local_steps=2", "eval.max_batches=1", "rounds=1"]
    overrides += pool_overrides(algorithm, tmp_path)
    cfg = compose(overrides, algorithm=algorithm, task="instructions", preset="test")
    strategy = registry.get(algorithm).plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg)).strategy
    nodes = {1: context(1), 2: context(2)}
    replies = train_round(cfg, strategy, 1, nodes)
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2, strategy.round_record()["refused"]
    metrics = evaluate_round(cfg, strategy, 1, nodes)
    assert 0.0 <= metrics["accuracy"] <= 1.0 and math.isfinite(metrics["loss"]), metrics


def test_an_instruction_run_reports_its_response_perplexity_beside_its_accuracy(tmp_path, caplog):
    """#60: task=instructions showed "accuracy 0 -> 0" in the console, summary.json and metrics.png while the
    response perplexity (61 -> 28) was only in metrics.jsonl. The run reports both where a user looks: a
    column of the round table, initial_/final_perplexity in summary.json, a panel of metrics.png; accuracy stays
    the run's metric (initial_metric / final_metric, what comparisons read)."""
    import logging

    import matplotlib.pyplot as plt
    from inprocess import run

    from fedapps.outputs import read_metrics, run_figure

    overrides = ["rounds=1", "train.local_steps=2", "eval.max_batches=1", "num_clients=2", f"output_dir={tmp_path}"]
    with caplog.at_level(logging.INFO, logger="flwr"):
        summary = run(compose(overrides, task="instructions", preset="test"))
    assert summary["metric"] == "accuracy" and summary["final_metric"] == summary["metric_by_round"]["1"]
    history = read_metrics(summary["run_dir"])
    ppl = [r["eval"]["perplexity"] for r in history]
    assert summary["initial_perplexity"] == ppl[0] and summary["final_perplexity"] == ppl[-1]
    assert summary["perplexity_by_round"] == {"0": ppl[0], "1": ppl[1]}
    lines = [r.getMessage() for r in caplog.records]
    (header,) = [line for line in lines if line.lstrip().startswith("round |")]
    assert [c.strip() for c in header.split("|")][:3] == ["round", "accuracy", "perplexity"]
    (row,) = [line for line in lines if line.split("|")[0].strip() == "1"]
    assert row.split("|")[2].strip() == f"{ppl[1]:.4f}"
    (final,) = [line for line in lines if line.startswith("Final accuracy:")]
    assert "; perplexity " in final
    fig = run_figure(history, "accuracy")
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy", "accuracy", "perplexity"]
    plt.close(fig)
    # a task with one metric keeps its table, summary and plot
    plain = [{"round": 0, "eval": {"perplexity": 9.0, "loss": 2.2}, "clients": []}]
    from fedapps.outputs import secondary_metrics

    assert secondary_metrics("perplexity", plain) == [] and len(run_figure(plain, "perplexity").axes) == 2
    plt.close("all")


def test_readmes_own_data_commands_compose_as_written(tmp_path):
    """#60: README's template example did not parse (Hydra's grammar); both its commands, split as a shell
    splits them (the data path made real), compose to the templates they name; a template file keeps
    newlines."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    block = (root / "README.md").read_text().split("## Your own data", 1)[1].split("```bash", 1)[1].split("```")[0]
    commands = [line for line in block.splitlines() if "/abs/qa.csv" in line]
    assert len(commands) == 2
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer,source\n" + "".join(f"what is {i},{i % 3},s{i % 2}\n" for i in range(40)))
    (tmp_path / "templates.yaml").write_text('prompt: "Q: {question}\\nA:"\nresponse: " {answer}"\n')
    printed = []
    for command in commands:
        args = [a.replace("/abs/qa.csv", str(csv)).replace("/abs/templates.yaml", str(tmp_path / "templates.yaml"))
                for a in shlex.split(command)[1:]]
        out = subprocess.run([sys.executable, "-m", "postcard.cli", *args, "num_clients=2", "--cfg", "job"],
                             cwd=root, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        from omegaconf import OmegaConf

        printed.append(OmegaConf.create(out.stdout).task)
    assert (printed[0].prompt, printed[0].response) == ("Q: {question}", " {answer}")
    assert (printed[1].prompt, printed[1].response) == ("Q: {question}\nA:", " {answer}")
    # through `overrides='...'` (flwr run, postcard.app_run) a template file needs no quoting either
    from fedapps.config import compose_from_run_config

    cfg = compose_from_run_config({"task": "instructions", "overrides": f"task.path={csv} task.group=source num_clients=2 "
                                                                        f"task.template_file={tmp_path}/templates.yaml"})
    assert cfg.task.prompt == "Q: {question}\nA:"
    (tmp_path / "bad.yaml").write_text("prompt: [1, 2]\n")
    with pytest.raises(ConfigError, match="task.template_file .*bad.yaml must map text, or prompt and response"):
        cfg_for(csv, f"task.template_file={tmp_path}/bad.yaml", task="instructions")
