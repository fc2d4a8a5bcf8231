"""Real data tasks on the embedded assets: MMLU's 5-client split, Shakespeare by play."""

import numpy as np
import pytest
import torch

from clients.models.llm import load_causal_lm
from clients.tasks import make_task
from clients.tasks.text import letter_token_ids, mmlu_prompt, mmlu_rows
from fedapps.config import compose


@pytest.fixture(scope="module")
def tiny():
    cfg = compose(preset="test")
    model, tok = load_causal_lm(cfg.model, seed=0)
    return model, tok


def test_mmlu_has_all_questions_and_every_subject_in_one_category():
    rows = mmlu_rows()
    assert len(rows) == 14042
    cfg = compose(task="mmlu")
    subjects = [s for group in cfg.task.categories.values() for s in group]
    assert len(subjects) == len(set(subjects)) == 57
    assert set(subjects) == {r["topic"] for r in rows}


def test_mmlu_prompt_format():
    row = {"question": "2+2?", "answer_a": "3", "answer_b": "4", "answer_c": "5", "answer_d": "6"}
    assert mmlu_prompt(row) == "Question: 2+2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"


def test_mmlu_natural_split_gives_one_super_category_per_client(tiny):
    _, tok = tiny
    cfg = compose(task="mmlu")
    tasks = [make_task(cfg, i, 5, tok) for i in range(5)]
    assert [t.categories for t in tasks] == [[c] for c in cfg.task.categories]
    math_cs = tasks[3]
    assert (math_cs.num_train, math_cs.num_test) == (915, 183)  # as in FedNL's Table 1
    for t in tasks:
        assert t.num_train <= 2000 and t.num_test <= 200
        assert not set(t.train_idx.tolist()) & set(t.test_idx.tolist())


def test_mmlu_batches_put_the_answer_letter_after_the_prompt(tiny):
    model, tok = tiny
    task = make_task(compose(task="mmlu"), 0, 5, tok)
    batch = task.collate(task.test_idx[:3])
    ids = letter_token_ids(tok)
    for row in range(3):
        last = int(batch["last"][row])
        assert int(batch["input_ids"][row, last + 1]) == ids[int(batch["answer"][row])]
        assert tok.decode(batch["input_ids"][row, : last + 1]).endswith("Answer:")
    metrics = task.evaluate(model, batch_size=4, max_batches=2)
    assert metrics["num-examples"] == 8 and 0.0 <= metrics["accuracy"] <= 1.0
    loss = task.loss(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_shakespeare_natural_split_is_by_play_and_windows_are_next_token_pairs(tiny):
    _, tok = tiny
    cfg = compose(preset="test")
    tasks = [make_task(cfg, i, 2, tok) for i in range(2)]
    assert [t.plays for t in tasks] == [sorted(["hamlet", "the-tempest"]), sorted(["macbeth", "twelfth-night"])]
    batch = tasks[0].collate(tasks[0].train_idx[:2])
    assert batch["input_ids"].shape == (2, cfg.train.seq_len)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    text = tok.decode(batch["input_ids"][0])
    assert "**" not in text and len(text) > 50


def test_train_batches_cycle_through_the_data_without_repeats_within_a_pass(tiny):
    _, tok = tiny
    task = make_task(compose(preset="test"), 0, 2, tok)
    seen = []
    for batch in task.train_batches(steps=5, batch_size=4, rng=np.random.default_rng(0)):
        seen += [tuple(x.tolist()) for x in batch["input_ids"]]
    assert len(seen) == len(set(seen)) == 20


# CIFAR-10 is skipped without the bigbench sdist (tests/conftest.py); Fashion-MNIST (10,000 of its
# 70,000 images, task.max_examples, grey repeated to RGB at 32 px) keeps the check
@pytest.mark.parametrize("dataset, size", [pytest.param("cifar10", 64, marks=pytest.mark.needs_cifar10),
                                           ("fmnist", 32)])
def test_image_task_partitions_by_dirichlet_label_skew(dataset, size):
    cfg = compose(["model=tiny-cnn", "partition.alpha=0.1"], task=dataset, algorithm="fedavg-full")
    tasks = [make_task(cfg, i, 4) for i in range(4)]
    assert sum(t.num_train + t.num_test for t in tasks) == 10000
    dominant = [max(t.label_histogram()) / sum(t.label_histogram()) for t in tasks]
    assert np.mean(dominant) > 0.3  # strong label skew at alpha=0.1
    batch = tasks[0].collate(tasks[0].train_idx[:5])
    assert batch["x"].shape == (5, 3, size, size) and batch["y"].shape == (5,)


def test_a_tuning_run_scores_a_validation_split_and_never_the_test_images():
    """task.eval_split=val: every client trains on fewer rows and scores ones carved from its training
    split; the test images of an ordinary run are in neither (docs/benchmarks.md, Protocol)."""
    cfg = compose(["model=tiny-cnn"], task="fmnist", algorithm="fedavg-full")
    tuned = compose(["model=tiny-cnn", "task.eval_split=val"], task="fmnist", algorithm="fedavg-full")
    for i in range(2):
        ordinary, tuning = make_task(cfg, i, 4), make_task(tuned, i, 4)
        assert not set(tuning.test_idx) & set(ordinary.test_idx)
        assert not set(tuning.train_idx) & set(ordinary.test_idx) and not set(tuning.train_idx) & set(tuning.test_idx)
        assert set(tuning.train_idx) | set(tuning.test_idx) == set(ordinary.train_idx)


# --------------------------------------------------------------------------- special tokens (BOS/EOS)
def word_tokenizer(template: str = "<s> $A"):
    """A tiny word-level tokenizer built here (no download) whose post-processor adds ``<s>`` (a BOS,
    as Gemma's and Llama's do) or whatever ``template`` says."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ("the of and to I you a my is in that not it be me with your this his for what but so "
             "HAMLET MACBETH Question Answer A B C D . , : ? !").split()
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_special_affixes_follow_the_tokenizer(tiny):
    from clients.tasks.text import special_affixes

    _, smollm2 = tiny
    assert special_affixes(smollm2) == ([], [])  # SmolLM2 adds none: its data are unchanged
    assert special_affixes(word_tokenizer()) == ([1], [])
    assert special_affixes(word_tokenizer("<s> $A </s>")) == ([1], [2])


def test_shakespeare_windows_start_with_the_bos_a_tokenizer_adds():
    """A tokenizer that adds a BOS (Gemma-3: perplexity 7-66x higher without it) gets one at the start of
    every window, never as a label; the rest of the window is the play's text, in order."""
    from clients.tasks.text import play_tokens

    tok = word_tokenizer()
    cfg = compose(preset="test")
    task = make_task(cfg, 0, 2, tok)
    assert task.windows.shape[1] == cfg.train.seq_len + 1
    assert bool((task.windows[:, 0] == 1).all())
    assert not bool((task.windows[:, 1:] == 1).any())
    batch = task.collate(task.train_idx[:4])
    assert bool((batch["input_ids"][:, 0] == 1).all()) and not bool((batch["labels"] == 1).any())
    body = play_tokens("hamlet", tok.name_or_path + str(len(tok)), tok)  # the play's text, no special tokens
    rows = {tuple(body[k * 32 : (k + 1) * 32].tolist()) for k in range(len(body) // 32)}
    assert all(tuple(w[1:].tolist()) in rows for w in task.windows[task.train_idx][:20])
    mmlu = make_task(compose(task="mmlu", preset="test"), 0, 5, tok)  # MMLU prompts start with it too
    assert bool((mmlu.collate(mmlu.test_idx[:3])["input_ids"][:, 0] == 1).all())


def test_smollm2_windows_are_the_plain_token_stream(tiny):
    """No special tokens for SmolLM2: every window is a cut of the play's tokens (the demo's numbers
    stay as they were)."""
    from clients.tasks.text import play_tokens

    _, tok = tiny
    cfg = compose(preset="test")
    task = make_task(cfg, 0, 2, tok)
    window = cfg.train.seq_len + 1
    rows = set()
    for play in ("hamlet", "the-tempest"):
        body = play_tokens(play, tok.name_or_path + str(len(tok)), tok)
        rows |= {tuple(body[k * window : (k + 1) * window].tolist()) for k in range(len(body) // window)}
    mine = np.concatenate([task.train_idx, task.test_idx])
    assert all(tuple(w.tolist()) in rows for w in task.windows[mine])


def test_a_plays_tokens_are_read_back_from_disk_and_keyed_by_the_tokenizer(tiny, tmp_path, monkeypatch):
    """A stock deployment's later messages (fresh processes) read a play's tokens from the asset cache
    instead of tokenising it; another tokenizer (another serialisation) gets tokens of its own."""
    from clients.tasks import text

    monkeypatch.setenv("POSTCARD_CACHE", str(tmp_path))
    _, tok = tiny
    text.play_tokens.cache_clear()
    first = text.play_tokens("hamlet", "k", tok)
    assert len(list((tmp_path / "tokens").glob("*.npy"))) == 1

    class Refuses:  # the same tokenizer as far as the key goes, but it must not be called
        backend_tokenizer = tok.backend_tokenizer

        def __len__(self):
            return len(tok)

        def __call__(self, *a, **k):
            raise AssertionError("tokenised again although its tokens are cached")

    text.play_tokens.cache_clear()
    np.testing.assert_array_equal(text.play_tokens("hamlet", "k", Refuses()), first)
    other = word_tokenizer()
    text.play_tokens.cache_clear()
    assert not np.array_equal(text.play_tokens("hamlet", "k", other), first)
    assert len(list((tmp_path / "tokens").glob("*.npy"))) == 2
    text.play_tokens.cache_clear()
