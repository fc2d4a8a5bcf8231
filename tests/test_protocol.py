"""bench/protocol.py: the one rule for "met" and the refusals of a protocol a reviewer would reject,
on hand-made examples (issue #43)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import protocol  # noqa: E402
from protocol import ProtocolError, check, verdict  # noqa: E402


@pytest.mark.parametrize("estimate, interval, margin, kind, higher, expected", [
    (+0.5, (-0.8, +1.8), -1.0, "non-inferiority", True, "met"),  # the whole interval above −1 pp
    (+0.5, (-1.5, +2.5), -1.0, "non-inferiority", True, "not shown"),  # the estimate within, the interval not
    (-3.5, (-3.9, -3.1), -1.0, "non-inferiority", True, "not met"),  # FLITE's IID gap on CIFAR-10
    (-1.0, (-1.0, -0.2), -1.0, "non-inferiority", True, "met"),  # at the margin counts
    (+0.5, None, -1.0, "non-inferiority", True, "not shown"),  # one seed: never met
    (+0.2, (+0.1, +0.3), 0.0, "superiority", True, "met"),
    (+0.2, (-0.1, +0.5), 0.0, "superiority", True, "not shown"),
    (0.0, (0.0, +0.5), 0.0, "superiority", True, "not met"),  # superiority is strict
    (-0.3, (-0.5, -0.1), 0.0, "superiority", False, "met"),  # perplexity: lower is better
    (+0.3, (+0.1, +0.5), 0.0, "non-inferiority", False, "not met"),  # a worse perplexity
])
def test_one_rule_for_met(estimate, interval, margin, kind, higher, expected):
    assert verdict(estimate, interval, margin, kind=kind, higher_is_better=higher) == expected


def test_flite_and_smartfed_reports_use_the_same_rule():
    import flite

    assert flite.verdict(-0.4, (-0.4, -0.9, +0.1)) == "met"
    assert flite.verdict(-3.5, (-3.5, -3.9, -3.1)) == "not met"
    assert flite.verdict(+0.5, (+0.5, -1.5, +2.5)).startswith("not shown")
    source = (Path(flite.__file__).parent / "smartfed.py").read_text()
    assert "protocol.verdict(" in source


def good():
    return {"tuning_seeds": [100, 101], "evaluation_seeds": [0, 1, 2, 3, 4], "split": "validation",
            "margin": -1.0, "kind": "non-inferiority",
            "arms": {"flite-int4": {"grid": {"train.lr": [1e-3, 3e-3, 1e-2]}, "best": {"train.lr": 3e-3}},
                     "fedavg-full": {"grid": {"train.lr": [3e-5, 1e-4, 3e-4]}, "best": {"train.lr": 1e-4}},
                     "theta-pre": {"no_training": True}}}


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(tuning_seeds=[0, 100]), r"seeds overlap: \[0\]"),
    (lambda p: p["arms"]["fedavg-full"].update(best={"train.lr": 3e-4}), "sits at the edge"),  # never bracketed
    (lambda p: p["arms"]["fedavg-full"]["grid"].update({"train.lr": [1e-4, 3e-4]}), "sits at the edge"),
    (lambda p: p["arms"].pop("theta-pre"), "no no-training arm"),
    (lambda p: p["arms"]["flite-int4"]["grid"].update({"train.lr": [1e-3, 2e-3, 3e-3, 1e-2, 3e-2]}),
     "tuning budgets differ"),
    (lambda p: p.update(split="test"), "tune on a validation split"),
    (lambda p: p.pop("margin"), "no margin stated"),
    (lambda p: p["arms"]["flite-int4"].update(best={"train.lr": 5e-3}), "not on its grid"),
])
def test_a_protocol_a_reviewer_would_reject_is_refused(change, message):
    check(good())
    bad = good()
    change(bad)
    with pytest.raises(ProtocolError, match=message):
        check(bad)


def test_the_command_refuses_in_one_line_with_exit_2(tmp_path, capsys):
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(good()))
    assert protocol.main(["check", str(path)]) == 0
    bad = good()
    bad["evaluation_seeds"] = [100, 1]
    path.write_text(json.dumps(bad))
    assert protocol.main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "seeds overlap: [100]" in err
    assert protocol.main(["check", str(tmp_path / "missing.json")]) == 2


def test_flite_parts_made_from_different_base_files_are_not_merged(tmp_path):
    """θ_pre is not bit-reproducible across CPUs: a report names its file's sha256 and parts of two bases refuse."""
    import flite

    settings = {"rounds": 8, "steps": 10, "batch_size": 32, "clients": 4, "base": "public", "task": "cifar10",
                "overrides": [], "methods": ["flite-int4"], "partitions": ["iid"]}

    def part(name, sha, seed):
        run = {"method": "flite-int4", "partition": "iid", "seed": seed, "lr": 3e-3}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"runs": {f"iid/flite-int4/{seed}": run}, "settings": settings,
                                    "base": {"sha256": sha}}))
        return path

    a, b, c = part("a", "aa" * 32, 0), part("b", "aa" * 32, 1), part("c", "bb" * 32, 2)
    assert len(flite.merge([a, b])["runs"]) == 2
    with pytest.raises(SystemExit, match="made from θ_pre bbbbbbbbbbbb"):
        flite.merge([a, c])
