"""The 7-template needle-in-a-haystack generator (model-free: word counts as tokens)."""

import random
import re
from pathlib import Path

import pytest
import yaml

from clients.tasks.niah import (
    DEPTHS,
    LETTERS,
    MAX_UNIT_WORDS,
    TEMPLATES,
    filler_units,
    make_example,
    make_split,
    token_counter,
    whitespace_tokens,
)


def char_tokens(text: str) -> int:
    """A second, very different counter: 4 characters per token."""
    return (len(text) + 3) // 4


def test_the_configured_templates_are_generated_and_an_unknown_one_is_refused():
    # what a user runs: conf/task/niah.yaml's seven templates (one per client), each generated as named
    configured = yaml.safe_load(open(Path(__file__).parents[1] / "conf" / "task" / "niah.yaml"))["templates"]
    assert len(configured) == 7 and set(configured) == set(TEMPLATES)
    for template in configured:
        assert make_example(template, 1024, random.Random(0), whitespace_tokens)["template"] == template
    with pytest.raises(ValueError, match="unknown NIAH template 'pass-key'; choose one of"):
        make_example("pass-key", 1024, random.Random(0), whitespace_tokens)


@pytest.mark.parametrize("template", TEMPLATES)
def test_example_structure(template):
    ex = make_example(template, 1024, random.Random(7), whitespace_tokens)
    prompt = ex["prompt"]
    # exactly one right choice among four distinct ones, and the letter points at it
    assert len(ex["choices"]) == 4 and len(set(ex["choices"])) == 4
    assert ex["choices"].count(ex["answer"]) == 1
    assert ex["choices"][LETTERS.index(ex["answer_letter"])] == ex["answer"]
    assert ex["answer_index"] == LETTERS.index(ex["answer_letter"])
    # the MMLU-style ending
    options = "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, ex["choices"]))
    assert prompt.endswith(f"Question: {ex['question']}{options}\nAnswer:")
    # four needles, in order, where the spans say, at the stated depths
    assert len(ex["needles"]) == 4
    assert [prompt[s:e] for s, e in ex["needle_positions"]] == list(ex["needles"])
    assert ex["target_depths"] == DEPTHS
    for measured, target in zip(ex["needle_depths"], DEPTHS):
        assert abs(measured - target) <= 0.02
    # length: never over the target, and close to it
    assert ex["num_tokens"] == whitespace_tokens(prompt)
    assert 0.97 * 1024 <= ex["num_tokens"] <= 1024


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_answer_is_in_the_haystack_and_negatives_are_hard(template):
    ex = make_example(template, 800, random.Random(11), whitespace_tokens)
    context = " ".join(ex["needles"])
    wrong = [c for c in ex["choices"] if c != ex["answer"]]
    if template == "counter-state":
        numbers = [int(x) for x in re.findall(r"\d+", context)]
        start, add, take, more = numbers
        assert int(ex["answer"]) == start + add - take + more
    elif template == "multi-value":
        values = re.findall(r"is (\d{7})\.", context)
        assert ex["answer"] == ", ".join(values)
        assert all(sorted(w.split(", ")) == sorted(values) or len(set(w.split(", ")) & set(values)) == 3 for w in wrong)
    else:
        assert ex["answer"] in context
        # at least two wrong options are the other needles' values (three for multi-key)
        in_text = sum(w in context for w in wrong)
        assert in_text >= (3 if template == "multi-key" else 2)


@pytest.mark.parametrize("length", [600, 2048, 4096])
def test_depths_and_lengths_hold_across_lengths_and_counters(length):
    for counter in (whitespace_tokens, char_tokens):
        ex = make_example("passkey", length, random.Random(length), counter)
        assert 0.97 * length <= ex["num_tokens"] <= length
        assert all(abs(m - t) <= 0.02 for m, t in zip(ex["needle_depths"], DEPTHS))


def test_same_seed_same_examples_and_different_seeds_or_templates_differ():
    a = make_split("name-date", 3, [700, 900], seed=5, tokenizer=whitespace_tokens)
    b = make_split("name-date", 3, [700, 900], seed=5, tokenizer=whitespace_tokens)
    assert a == b
    assert make_split("name-date", 2, [700, 900], seed=5, tokenizer=whitespace_tokens) == a[:2]
    assert [ex["length_tokens"] for ex in a] == [700, 900, 700]
    other_seed = make_split("name-date", 3, [700, 900], seed=6, tokenizer=whitespace_tokens)
    assert all(x["prompt"] != y["prompt"] for x, y in zip(a, other_seed))
    prompts = {make_split(t, 1, [700], seed=5, tokenizer=whitespace_tokens)[0]["question"] for t in TEMPLATES}
    assert len(prompts) == len(TEMPLATES)


def test_answer_letters_are_spread_out():
    letters = [ex["answer_letter"] for ex in make_split("multi-key", 40, [500], seed=0, tokenizer=whitespace_tokens)]
    assert set(letters) == set(LETTERS)


def test_filler_is_clean_shakespeare():
    units = filler_units()
    assert len(units) > 50_000
    text = " ".join(units[:5000])
    assert "Who's there?" in units
    assert not re.search(r"[#*_]", text)
    assert max(len(u.split()) for u in units) <= MAX_UNIT_WORDS


def test_hf_style_tokenizers_are_counted_with_encode():
    class FakeTokenizer:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return text.split()

    count = token_counter(FakeTokenizer())
    assert count("to be or not") == 4
    ex = make_example("phrase-code", 700, random.Random(1), FakeTokenizer())
    assert ex["num_tokens"] <= 700
    with pytest.raises(TypeError, match="tokenizer"):
        token_counter(42)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown NIAH template"):
        make_example("haystack", 1000, random.Random(0), whitespace_tokens)
    with pytest.raises(ValueError, match="too short"):
        make_example("multi-value", 60, random.Random(0), whitespace_tokens)
    with pytest.raises(ValueError, match="length_tokens"):
        make_example("passkey", 0, random.Random(0), whitespace_tokens)
    with pytest.raises(ValueError, match="lengths"):
        make_split("passkey", 2, [], seed=0, tokenizer=whitespace_tokens)
    with pytest.raises(ValueError, match="token counter"):
        make_example("passkey", 1000, random.Random(0), lambda text: 0)
