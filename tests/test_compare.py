"""Paired comparisons of finished runs on the same held-out items (postcard compare)."""

import json
import math

import numpy as np
import pytest
import torch

from fedapps.config import compose, to_yaml
from fedapps.final import load_run
from postcard.compare import CompareError, compare, main, mcnemar_exact, noninferiority, paired_interval, wilson


def test_the_intervals_and_the_exact_mcnemar_test_match_known_values():
    assert wilson(8, 10) == pytest.approx((0.49016, 0.94332), abs=1e-5)
    ref = np.array([0] * 10 + [1] * 2 + [1] * 30 + [0] * 8)
    other = np.array([1] * 10 + [0] * 2 + [1] * 30 + [0] * 8)
    test = mcnemar_exact(ref, other)  # 10 gains, 2 losses: p = P(|X - 6| >= 4), X ~ Bin(12, 1/2)
    assert (test["other_right_ref_wrong"], test["ref_right_other_wrong"]) == (10, 2)
    assert test["p_value"] == pytest.approx(0.03857421875)
    assert mcnemar_exact(ref, ref)["p_value"] == 1.0
    mean, low, high = paired_interval(np.array([1.0, 2.0, 3.0, 4.0]), t=True)
    assert (mean, low, high) == pytest.approx((2.5, 2.5 - 3.182446 * 1.290994 / 2, 2.5 + 3.182446 * 1.290994 / 2),
                                              rel=1e-5)


def test_the_noninferiority_test_matches_a_hand_computed_example():
    """40 items: the compared run gains 6 and loses 4 (paired differences +1 x6, -1 x4, 0 x30):
    mean 0.05, sample std sqrt((10 - 40 * 0.05**2) / 39); H0: mean <= -0.02."""
    d = np.array([1.0] * 6 + [-1.0] * 4 + [0.0] * 30)
    se = math.sqrt((10 - 40 * 0.05 ** 2) / 39) / math.sqrt(40)
    z = (0.05 + 0.02) / se
    assert noninferiority(d, 0.02) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=1e-9)
    assert noninferiority(d, 0.02) < noninferiority(d, 0.0) < 0.5  # a wider margin is easier to clear
    assert noninferiority(-d, 0.0) > 0.5  # a run that loses more than it gains is not shown non-inferior
    ref = np.array([0.0] * 6 + [1.0] * 4 + [1.0] * 15 + [0.0] * 15)
    other = np.array([1.0] * 6 + [0.0] * 4 + [1.0] * 15 + [0.0] * 15)  # other - ref is d
    result = compare({"ref": {"client": np.zeros(40), "index": np.arange(40), "loss": np.zeros(40), "correct": ref},
                      "run": {"client": np.zeros(40), "index": np.arange(40), "loss": np.zeros(40), "correct": other}},
                     "ref", "accuracy", margin=0.05)
    assert result["margin"] == 0.05
    assert result["runs"]["run"]["accuracy_diff"]["noninferior_p"] == pytest.approx(noninferiority(d, 0.05))


def test_items_score_exactly_what_the_evaluation_averages():
    """Per-item scores are the evaluation's, one by one: their means are its accuracy and loss."""
    from clients.models import build_model
    from clients.tasks import make_task

    niah = compose(["task.train_per_template=2", "task.test_per_template=4", "task.train_lengths=[640]",
                    "task.test_lengths=[640,768]"], preset="test", task="niah")
    for cfg in (compose(["num_clients=5", "task.max_test=12", "eval.batch_size=5"], preset="test", task="mmlu"),
                compose(["eval.batch_size=3"], preset="test"), niah):
        model, tok = build_model(cfg)
        task = make_task(cfg, 1, int(cfg.num_clients or cfg.task.default_clients), tok)
        size = {"shakespeare": 3, "mmlu": 5, "niah": 2}[cfg.task.name]
        metrics = task.evaluate(model, size, 2)
        items = task.items(model, size, 2)
        assert len(items["index"]) == metrics["num-examples"]
        np.testing.assert_array_equal(items["index"], task.test_idx[: metrics["num-examples"]])
        assert float(np.mean(items["loss"])) == pytest.approx(metrics["loss"], rel=1e-5)
        if "accuracy" in metrics:
            assert float(np.mean(items["correct"])) == pytest.approx(metrics["accuracy"])


def _finished_run(folder, cfg, shift: float):
    """A run folder as a finished fedavg-lora run leaves it, with its LoRA B moved by ``shift``."""
    from fedapps import baselines

    folder.mkdir()
    plan = baselines.plan_server(cfg, on_round_end=None, config_yaml="")
    generator = torch.Generator().manual_seed(1)
    state = {k: v + (shift * torch.randn(v.shape, generator=generator).numpy() if "lora_B" in k else 0)
             for k, v in plan.strategy.global_state.items()}
    plan.save_final(state, folder)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    (folder / "summary.json").write_text(json.dumps({"status": "completed", "final_metric": 0.25}))
    return folder


def test_postcard_compare_pairs_runs_on_the_same_items_and_refuses_others(tmp_path, capsys):
    cfg = compose(["num_clients=2", "task.max_test=10", "eval.max_batches=0"], preset="test", task="mmlu",
                  partition="iid")
    ref = _finished_run(tmp_path / "ref", cfg, 0.0)
    other = _finished_run(tmp_path / "other", cfg, 2.0)
    assert main([str(ref), str(other), "--out", str(tmp_path / "cmp")]) == 0
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["items"] == 20 and result["reference"] == "ref"
    row = result["runs"]["other"]
    diff = row["accuracy_diff"]
    assert diff["mean"] == pytest.approx(row["accuracy"] - result["runs"]["ref"]["accuracy"])
    assert diff["ci95"][0] <= diff["mean"] <= diff["ci95"][1] and 0 <= diff["p_value"] <= 1
    assert "McNemar" in (tmp_path / "cmp" / "compare.md").read_text()
    kept = sorted(ref.glob("items-*.npz"))  # kept beside the run, one file per scoring settings
    assert len(kept) == 1
    # scoring the same run with other evaluation settings adds a file, and the first is reused as it is
    final = load_run(ref)
    final.cfg.eval.max_batches = 1
    assert len(final.items()["index"]) < 20
    assert len(list(ref.glob("items-*.npz"))) == 2
    stamp = kept[0].stat().st_mtime_ns
    final.cfg.eval.max_batches = 0
    assert len(final.items()["index"]) == 20 and kept[0].stat().st_mtime_ns == stamp
    # a run scored on other items (another seed) cannot be paired with them
    third = _finished_run(tmp_path / "third", compose(["num_clients=2", "task.max_test=10", "eval.max_batches=0",
                                                        "seed=7"], preset="test", task="mmlu", partition="iid"), 0.0)
    assert main([str(ref), str(third)]) == 2
    assert "scored on other items" in capsys.readouterr().err
    with pytest.raises(CompareError, match="other items"):
        compare({"a": {"client": np.zeros(2), "index": np.arange(2), "loss": np.zeros(2)},
                 "b": {"client": np.zeros(2), "index": np.arange(1, 3), "loss": np.zeros(2)}}, "a", "accuracy")
