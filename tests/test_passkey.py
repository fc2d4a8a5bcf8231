"""task=passkey (clients/tasks/passkey.py): prompts of the asked token length with the key beyond the
window, splits from disjoint seeds, exact match under teacher forcing, the loss on the answer only,
bad settings refused, and tiny in-process federated runs (fedavg-lora, FedNL) reporting accuracy."""

import pytest
import torch
import torch.nn.functional as F

from clients.models import build_model
from clients.tasks import make_task
from clients.tasks.base import TaskError
from clients.tasks.passkey import SPLITS, make_example, split_example, split_seed_key
from clients.tasks.passkey_task import exact_match
from fedapps.config import ConfigError, compose
from fedapps.outputs import read_metrics

SMALL = ["task.train_per_filler=2", "task.test_per_filler=2", "task.train_lengths=[256]",
         "task.test_lengths=[256,320]", "task.min_distance=64", "eval.batch_size=2"]


@pytest.fixture(scope="module")
def tiny():
    """(config, tiny random-init Llama, SmolLM2's tokenizer), built once for the module."""
    cfg = compose(SMALL, preset="test", task="passkey", algorithm="fedavg-lora")
    return (cfg, *build_model(cfg))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[2]


@pytest.mark.parametrize("filler", ["grass", "shakespeare"])
def test_prompts_are_deterministic_of_the_asked_length_with_the_key_far_enough_back(tokenizer, filler):
    for length in (256, 512):
        ex = split_example("test", 3, filler, [length], 0, tokenizer, min_distance=160)
        assert ex == split_example("test", 3, filler, [length], 0, tokenizer, min_distance=160)  # reproducible
        ids = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        assert ex["num_tokens"] == len(ids) and length - 4 <= len(ids) <= length
        begin, end = ex["needle_position"]
        assert ex["prompt"][begin:end] == f"The pass key is {ex['key']}. Remember it. {ex['key']} is the pass key."
        after = len(ids) - len(tokenizer(ex["prompt"][:end], add_special_tokens=False)["input_ids"])
        assert ex["distance"] == after and after >= 160  # beyond a window of up to 160 tokens
        assert ex["prompt"].count(ex["key"]) == 2 and ex["prompt"].endswith("What is the pass key? The pass key is")
        assert ex["answer"] == f" {ex['key']}" and len(ex["key"]) == 5
    # with no distance asked, the depth follows the drawn target
    ex = make_example("grass", 1024, 11, tokenizer)
    assert abs(ex["depth"] - ex["target_depth"]) < 0.03 and 0.05 <= ex["target_depth"] <= 0.6


def test_splits_come_from_disjoint_seeds_and_share_no_prompt(tokenizer):
    keys = {split: {split_seed_key(split, 0, f, i) for f in ("grass", "shakespeare") for i in range(50)}
            for split in SPLITS}
    assert not (keys["train"] & keys["val"]) and not (keys["train"] & keys["test"]) and not (keys["val"] & keys["test"])
    prompts = {split: {split_example(split, i, "grass", [256], 0, tokenizer)["prompt"] for i in range(6)}
               for split in SPLITS}
    assert all(len(p) == 6 for p in prompts.values())
    assert not (prompts["train"] & prompts["test"]) and not (prompts["train"] & prompts["val"])
    with pytest.raises(ValueError, match="unknown split"):
        split_seed_key("dev", 0, "grass", 0)


def test_exact_match_on_hand_made_logits():
    vocab, answer = 12, [3, 7, 7, 1, 9]
    labels = torch.tensor([[-100, -100, *answer], [-100, -100, *answer]])
    logits = torch.zeros(2, 7, vocab)
    for t, token in enumerate(answer):
        logits[:, 2 + t, token] = 5.0  # both rows right...
    logits[1, 4, 7], logits[1, 4, 2] = 0.0, 5.0  # ...but row 1's third digit is a 2
    logits[:, :2, 0] = 9.0  # prompt positions are not scored
    exact, tokens = exact_match(logits, labels)
    assert exact.tolist() == [1.0, 0.0] and tokens.tolist() == pytest.approx([1.0, 0.8])
    with pytest.raises(ValueError, match="no scored"):
        exact_match(logits, torch.full((2, 7), -100))


def test_the_loss_is_on_the_answer_tokens_only_and_evaluation_reports_accuracy_per_length(tiny):
    cfg, model, tokenizer = tiny
    task = make_task(cfg, 0, 2, tokenizer)
    assert task.client_fillers == ["grass"] and task.num_train == 2 and task.num_test == 2
    assert make_task(cfg, 1, 2, tokenizer).client_fillers == ["shakespeare"]  # natural split: one filler each
    batch = task.collate(task.test_idx)
    for row, index in enumerate(task.test_idx):
        prompt, answer, _ = task._encoded(index)
        labels = batch["labels"][row]
        assert labels[labels != -100].tolist() == answer  # the answer's tokens, nothing else
        assert (labels != -100).nonzero()[0].item() == len(prompt) - 1  # first scored: the prompt's last position
        assert batch["input_ids"][row, : len(prompt)].tolist() == prompt
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        scored = batch["labels"] != -100
        expected = F.cross_entropy(logits[scored], batch["labels"][scored])
        assert task.loss(model, batch).item() == pytest.approx(expected.item(), rel=1e-5)
        exact, _ = exact_match(logits, batch["labels"])
        assert task.item_scores(model, batch)["correct"].tolist() == exact.tolist()
    metrics = task.evaluate(model, 2, 0)
    assert {"accuracy", "token-accuracy", "loss", "num-examples", "accuracy-256", "accuracy-320"} <= set(metrics)
    assert metrics["num-examples"] == 2


@pytest.mark.parametrize("override, match", [
    ("task.fillers=[grass,wikipedia]", "task.fillers must be distinct names"),
    ("task.test_lengths=[48]", "no longer than the method's softmax window"),
    ("task.min_distance=32", "inside the method's softmax window"),
    ("task.depth=[0.7,0.2]", "task.depth must be"),
    ("task.eval_split=train", "task.eval_split must be test or val"),
])
def test_bad_settings_are_refused_clearly(override, match):
    # when the configuration is composed (fedapps.checks), before any client starts
    with pytest.raises(ConfigError, match=match):
        compose([*SMALL, override, "algorithm.memory.window=48"], preset="test", task="passkey", algorithm="fednl")


def test_a_length_too_short_for_the_distance_is_refused(tokenizer):
    cfg = compose([*SMALL, "task.min_distance=300"], preset="test", task="passkey", algorithm="fedavg-lora")
    with pytest.raises(TaskError, match="too short"):
        make_task(cfg, 0, 2, tokenizer)


@pytest.mark.parametrize("algorithm, extra", [("fedavg-lora", []),
                                              ("fednl", ["algorithm.memory.window=32", "algorithm.eval_local=false"])])
def test_a_tiny_federated_run_reports_the_accuracy(outputs, algorithm, extra):
    from inprocess import run as simulate  # run_server in this process (no Ray start)

    cfg = compose([*SMALL, *extra, "rounds=1", "train.local_steps=1", "train.batch_size=1",
                   "task.test_lengths=[256]", "task.test_per_filler=1"], preset="test", task="passkey",
                  algorithm=algorithm)
    summary = simulate(cfg)
    final = read_metrics(summary["run_dir"])[-1]
    assert summary["refused_replies"] == 0
    assert {"accuracy", "accuracy-256", "token-accuracy"} <= set(final["eval"])
    assert all(0.0 <= c["eval_accuracy"] <= 1.0 for c in final["clients"])
