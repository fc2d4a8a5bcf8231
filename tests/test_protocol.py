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


@pytest.mark.parametrize("estimate, interval, margin, kind, higher, untrained, expected", [
    # FLITE on CIFAR-10 under Dirichlet 0.1: +2.3 pp (−0.9..+5.5) over full FedAvg, but θ_pre alone is +2.7
    (+2.3, (-0.9, +5.5), -1.0, "non-inferiority", True, +2.7, "uninformative"),
    (+2.3, (-0.9, +5.5), -1.0, "non-inferiority", True, -1.0, "uninformative"),  # at the margin counts for both
    (-0.3, (-0.6, -0.1), -1.0, "non-inferiority", True, -1.7, "met"),  # Fashion-MNIST Dirichlet: θ_pre fails
    (+0.5, (-1.5, +2.5), -1.0, "non-inferiority", True, +3.0, "not shown"),  # only a "met" can be uninformative
    (-3.5, (-3.9, -3.1), -1.0, "non-inferiority", True, +3.0, "not met"),
    (+50.0, (+45.0, +55.0), 20.0, "superiority", True, 0.0, "met"),  # passkey: FedNL untrained finds nothing
    (+50.0, (+45.0, +55.0), 20.0, "superiority", True, 25.0, "uninformative"),
    (-0.3, (-0.5, -0.1), 0.0, "superiority", False, -0.2, "uninformative"),  # perplexity: round 0 lower too
    (-0.3, (-0.5, -0.1), 0.0, "superiority", False, +5.0, "met"),
])
def test_a_met_that_not_training_reaches_too_is_uninformative(estimate, interval, margin, kind, higher, untrained,
                                                              expected):
    assert verdict(estimate, interval, margin, kind=kind, higher_is_better=higher, no_training=untrained) == expected


def test_a_non_finite_no_training_difference_is_refused():
    with pytest.raises(ProtocolError, match="no-training"):
        verdict(+0.5, (-0.8, +1.8), -1.0, no_training=float("nan"))


def test_flite_and_smartfed_reports_use_the_same_rule():
    import flite
    import flite_report

    assert flite_report.verdict(-0.4, (-0.4, -0.9, +0.1)) == "met"
    assert flite_report.verdict(-3.5, (-3.5, -3.9, -3.1)) == "not met"
    assert flite_report.verdict(+0.5, (+0.5, -1.5, +2.5)).startswith("not shown")
    assert flite_report.verdict(+2.3, (+2.3, -0.9, +5.5), -1.0, no_training=+2.7).startswith("uninformative: θ_pre")
    assert flite_report.verdict(-0.3, (-0.3, -0.6, -0.1), -1.0, no_training=-1.7) == "met"
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


def test_the_best_grid_value_is_the_best_mean_over_tuning_seeds():
    assert protocol.best_on_grid({1e-3: [0.80, 0.84], 3e-3: [0.85, 0.83], 1e-2: [0.70, 0.90]}) == 3e-3
    assert protocol.best_on_grid({1.0: [3.1], 2.0: [2.9], 3.0: [3.0]}, higher_is_better=False) == 2.0
    with pytest.raises(ProtocolError, match="unequal tuning runs per grid value"):
        protocol.best_on_grid({1e-3: [0.8, 0.8], 3e-3: [0.9]})


def test_ties_within_a_stated_tolerance_take_the_middle_value_and_a_plateau_at_an_edge_is_still_refused():
    """An arm at its metric's ceiling at every value (full attention on passkey: answer CE < 1e-6 nats at
    every rate) gets an inner value, not whichever edge the smallest rounding error points at; a plateau
    that only touches an edge still fails the check."""
    ceiling = {1e-4: [6.7e-7], 3e-4: [6.3e-8], 1e-3: [8.1e-8], 3e-3: [4.5e-9]}
    assert protocol.best_on_grid(ceiling, higher_is_better=False) == 3e-3  # no tolerance: the smallest CE, an edge
    entry = protocol.arm_entry(ceiling, "train.lr", higher_is_better=False, tolerance=1e-3)
    assert entry["best"] == {"train.lr": 3e-4} and entry["tied_within"]["train.lr"] == sorted(ceiling)
    edge = {1e-4: [0.10], 3e-4: [0.1005], 1e-3: [0.5]}
    spec = {"tuning_seeds": [100], "evaluation_seeds": [0], "margin": 0.0, "kind": "superiority",
            "arms": {"a": protocol.arm_entry(edge, "train.lr", higher_is_better=False, tolerance=1e-3),
                     "none": {"no_training": True}}}
    assert spec["arms"]["a"]["best"] == {"train.lr": 1e-4}
    with pytest.raises(ProtocolError, match="sits at the edge"):
        protocol.check(spec)
    assert protocol.best_on_grid({1.0: [0.5], 2.0: [0.5], 3.0: [0.4]}) == 1.0  # exact ties: the lower middle
    with pytest.raises(ProtocolError, match="tolerance"):
        protocol.best_on_grid(ceiling, tolerance=-1)


def git(cwd, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_an_evaluation_runs_only_under_a_protocol_committed_as_it_is(tmp_path):
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(good()))
    with pytest.raises(ProtocolError, match="not in a git repository|not committed"):
        protocol.committed(path)
    git(tmp_path, "init", "-q")
    with pytest.raises(ProtocolError, match="not committed as it is now"):
        protocol.committed(path)
    git(tmp_path, "add", "protocol.json")
    git(tmp_path, "commit", "-qm", "protocol")
    commit = protocol.committed(path)
    assert len(commit) == 40
    path.write_text(json.dumps({**good(), "margin": -3.0}))  # loosened after the fact
    with pytest.raises(ProtocolError, match="not committed as it is now"):
        protocol.committed(path)


def fake_tuning(grid_scores: dict) -> dict:
    """A tuning.json of bench/flite.py --tune: (partition, method) -> {lr: validation accuracy}."""
    runs = {}
    for (partition, method), scores in grid_scores.items():
        for lr, acc in scores.items():
            runs[f"{partition}/{method}/{lr:g}/100"] = {"method": method, "partition": partition, "seed": 100,
                                                       "lr": lr, "initial_accuracy": 0.80, "final_accuracy": acc}
    settings = {"rounds": 8, "steps": 20, "batch_size": 32, "clients": 4, "base": "public", "task": "fmnist",
                "overrides": ["task.eval_split=val"], "methods": [], "partitions": ["iid"]}
    return {"runs": runs, "settings": settings, "base": {"sha256": "ab" * 32}}


def draft_args(partitions=("iid", "dirichlet")):
    import argparse

    import flite


    return argparse.Namespace(evaluation_seeds=[0, 1, 2], margin=-1.0, partitions=list(partitions),
                              methods=list(flite.METHODS))


def test_a_protocol_may_cover_a_part_of_the_tuning_runs():
    """--tune --partitions iid --draft protocol-iid.json: the IID arms only (Dirichlet's grids may still be
    open: each protocol is checked on its own arms)."""
    import flite

    both = fake_tuning({("iid", "flite-int4"): {1e-3: 0.85, 3e-3: 0.87, 1e-2: 0.84},
                        ("dirichlet", "flite-int4"): {1e-3: 0.89, 3e-3: 0.87, 1e-2: 0.84}})
    with pytest.raises(ProtocolError, match="'dirichlet/flite-int4'.*sits at the edge"):
        check(flite.draft_protocol(both, draft_args()))
    iid = flite.draft_protocol(both, draft_args(["iid"]))
    check(iid)
    assert [a for a in iid["arms"] if "/" in a] == ["iid/flite-int4"]


def test_tuning_drafts_a_protocol_that_the_check_passes_only_when_every_grid_brackets_its_best(tmp_path):
    import argparse

    import flite

    import flite_report

    args = argparse.Namespace(evaluation_seeds=[0, 1, 2], margin=-1.0, partitions=["iid", "dirichlet"],
                              methods=list(flite.METHODS))
    inside = fake_tuning({("iid", "flite-int4"): {1e-3: 0.85, 3e-3: 0.87, 1e-2: 0.84},
                          ("iid", "fedavg-full"): {3e-5: 0.86, 1e-4: 0.88, 3e-4: 0.80}})
    draft = flite.draft_protocol(inside, args)
    check(draft)
    assert draft["arms"]["iid/flite-int4"]["best"] == {"train.lr": 3e-3} and draft["tuning_seeds"] == [100]
    assert draft["settings"]["overrides"] == [] and draft["settings"]["base_sha256"] == "ab" * 32
    assert draft["arms"]["theta-pre"]["no_training"]
    edge = fake_tuning({("iid", "flite-int4"): {1e-3: 0.89, 3e-3: 0.87, 1e-2: 0.84},
                        ("iid", "fedavg-full"): {3e-5: 0.86, 1e-4: 0.88, 3e-4: 0.80}})
    with pytest.raises(ProtocolError, match="'iid/flite-int4': its best train.lr = 0.001 sits at the edge"):
        check(flite.draft_protocol(edge, args))
    text = flite_report.tuning_report(inside, draft, None, "bench/flite.py --tune ...")
    assert "lr 0.003 → **0.8700**" in text and "passes" in text and "round 0) on the same validation items: iid 0.8000" in text


def test_flite_evaluation_refuses_a_protocol_that_is_not_committed_or_fails_the_check(tmp_path, capsys):
    import flite

    args = ["--protocol", str(tmp_path / "protocol.json"), "--out", str(tmp_path / "out")]
    draft = flite.draft_protocol(fake_tuning({("iid", "flite-int4"): {1e-3: 0.85, 3e-3: 0.87, 1e-2: 0.84},
                                              ("iid", "fedavg-full"): {3e-5: 0.86, 1e-4: 0.88, 3e-4: 0.80}}),
                                 draft_args())
    (tmp_path / "protocol.json").write_text(json.dumps(draft))
    with pytest.raises(SystemExit) as exit_:
        flite.parse_args(args)
    assert exit_.value.code == 2 and "commit the protocol before the evaluation runs" in capsys.readouterr().err
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "protocol.json")
    git(tmp_path, "commit", "-qm", "protocol")
    parsed = flite.parse_args(args)
    assert parsed.methods == ["flite-int4", "fedavg-full"] and parsed.partitions == ["iid"]
    assert parsed.seed_list == [0, 1, 2] and (parsed.rounds, parsed.steps, parsed.task) == (8, 20, "fmnist")
    assert flite.lr_of(parsed, "flite-int4", "iid") == 3e-3 and flite.lr_of(parsed, "fedavg-full", "iid") == 1e-4
    assert all(m in flite.REPEATED or flite.seeds_of(parsed, m) == [0, 1, 2] for m in parsed.methods)
    assert flite.parse_args([*args, "--methods", "fedavg-full"]).methods == ["fedavg-full"]  # a part of the arms
    with pytest.raises(SystemExit) as exit_:
        flite.parse_args([*args, "--partitions", "dirichlet"])
    assert exit_.value.code == 2 and "leave none of the protocol's arms (iid/flite-int4" in capsys.readouterr().err
    draft["evaluation_seeds"] = [100, 1]  # overlaps the tuning seed
    (tmp_path / "protocol.json").write_text(json.dumps(draft))
    git(tmp_path, "commit", "-qam", "overlap")
    with pytest.raises(SystemExit) as exit_:
        flite.parse_args(args)
    assert exit_.value.code == 2 and "seeds overlap: [100]" in capsys.readouterr().err


def test_a_report_under_a_protocol_names_its_commit_and_carries_the_no_training_arm():
    import flite
    import flite_report

    spec = flite.draft_protocol(fake_tuning({("iid", "flite-int4"): {1e-3: 0.85, 3e-3: 0.87, 1e-2: 0.84},
                                             ("iid", "fedavg-full"): {3e-5: 0.86, 1e-4: 0.88, 3e-4: 0.80}}),
                                draft_args())
    runs = {}
    for method, lr, finals in (("flite-int4", 3e-3, (0.86, 0.87, 0.88)), ("fedavg-full", 1e-4, (0.86, 0.88, 0.88))):
        for seed, final in enumerate(finals):
            runs[f"iid/{method}/{seed}"] = {
                "method": method, "partition": "iid", "seed": seed, "lr": lr, "initial_accuracy": 0.80,
                "final_accuracy": final, "uplink_bytes_per_client_round": 648 if method == "flite-int4" else 8_946_728,
                "downlink_bytes_per_client_round": 648, "seconds": 60, "curve": []}
    results = {"runs": runs, "settings": {"partitions": ["iid"], "methods": ["flite-int4", "fedavg-full"],
                                          "clients": 4, "rounds": 8, "steps": 20, "batch_size": 32,
                                          "task": "fmnist", "base": "public"},
               "protocol": {"file": "docs/x/protocol.json", "commit": "c0ffee" * 6 + "abcd", **spec}}
    text = flite_report.report(results, "bench/flite.py --protocol docs/x/protocol.json", "here")
    assert "committed at c0ffeec0ffee" in text and "| θ_pre (no training: round 0) |" in text
    assert "gain over θ_pre (no training)" in text and "flite-int4 +7.0 pp" in text
    assert "flite-int4 is -0.3 pp from fedavg-full" in text


def fake_smartfed_runs(split: str, seeds, finals: dict) -> list[dict]:
    """bench/smartfed_protocol.py runs: arm -> {value: final perplexity} (the same for every seed, plus seed/10)."""
    return [{"arm": arm, "value": value, "seed": seed, "split": split, "metric": "perplexity", "initial_metric": 60.0,
             "final_metric": final + seed / 10, "uplink_bytes_per_client_round": 1000, "run_dir": "r"}
            for arm, values in finals.items() for value, final in values.items() for seed in seeds]


def test_smartfed_tuning_drafts_a_checked_protocol_and_the_report_judges_by_the_one_rule():
    import argparse

    import smartfed_protocol as sp

    tuning = fake_smartfed_runs("val", [100], {
        "smartfed-tuned": {1e-3: 32.0, 3e-3: 30.5, 1e-2: 31.0}, "fedavg-lora": {1e-3: 31.3, 3e-3: 30.3, 1e-2: 30.9},
        "fedavg-lora-int4": {1e-3: 31.4, 3e-3: 30.4, 1e-2: 31.5}})
    args = argparse.Namespace(evaluation_seeds=[42, 43, 44], margin=0.0)
    spec = sp.draft(tuning, args, {"model": "smollm2", "task": "shakespeare"})
    check(spec)
    assert spec["arms"]["fedavg-lora"]["best"] == {"train.lr": 3e-3}
    assert spec["arms"]["smartfed-tuned"]["best"] == {"algorithm.lr.experts": 3e-3}
    assert spec["arms"]["round-0"]["no_training"] and spec["tuning_seeds"] == [100]
    assert "screening about seven variants on seed 42" in spec["changes_after_results"][0]  # before the protocol
    edge = fake_smartfed_runs("val", [100], {"smartfed-tuned": {1e-3: 32.0, 3e-3: 30.5, 1e-2: 31.0},
                                             "fedavg-lora": {1e-3: 31.3, 3e-3: 30.3, 1e-2: 29.9}})
    with pytest.raises(ProtocolError, match="'fedavg-lora': its best train.lr = 0.01 sits at the edge"):
        check(sp.draft(edge, args, {}))
    evaluation = fake_smartfed_runs("test", [42, 43, 44], {"smartfed-tuned": {3e-3: 30.0}, "fedavg-lora": {3e-3: 31.0},
                                                           "fedavg-lora-int4": {3e-3: 29.0}})
    evaluation[0]["final_metric"] += 0.2  # spread, so the intervals have a width
    text = sp.report({"command": "bench/smartfed_protocol.py --protocol p.json", "date": "today", "runs": evaluation,
                      "protocol": {**spec, "file": "p.json", "commit": "f00d" * 10}})
    assert "committed at f00df00df00d" in text and "| fedavg-lora | train.lr=0.003 | 3 | 60.00 |" in text
    assert "vs fedavg-lora: -0.93 perplexity over 3 seeds" in text and "**met**" in text  # lower is better
    assert "vs fedavg-lora-int4: +1.07" in text and "**not met**" in text
    for run in evaluation:  # the pool's mixture alone (round 0) already below fedavg-lora: a "met" says nothing
        if run["arm"] == "smartfed-tuned":
            run["initial_metric"] = 30.5
    text = sp.report({"command": "c", "date": "today", "runs": evaluation,
                      "protocol": {**spec, "file": "p.json", "commit": "f00d" * 10}})
    assert "vs fedavg-lora: -0.93 perplexity over 3 seeds (95% interval" in text
    assert "SmartFed's round 0 − this baseline's final: -4.80): **uninformative**" in text


def test_smartfed_protocol_refuses_unequal_budgets_and_an_uncommitted_protocol(tmp_path, capsys):
    import smartfed_protocol as sp

    with pytest.raises(SystemExit):
        sp.parse_args(["--tune", "--grid", "fedavg-lora=1e-3,3e-3,1e-2,3e-2"])
    assert "the same tuning budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sp.parse_args([])
    assert "say --tune" in capsys.readouterr().err
    (tmp_path / "p.json").write_text(json.dumps(good()))
    with pytest.raises(SystemExit) as exit_:
        sp.parse_args(["--protocol", str(tmp_path / "p.json")])
    assert exit_.value.code == 2 and "commit the protocol before the evaluation runs" in capsys.readouterr().err


def test_smartfed_protocol_refuses_runs_of_another_pool(tmp_path, monkeypatch, capsys):
    """Tuning spans sessions and a new checkout rebuilds the pool (not bit-identical on another CPU): a tuning
    resumed, or an evaluation, on a pool whose adapters' sha256 differs from the recorded one is refused."""
    import smartfed_protocol as sp

    def fake_setup(args):
        args.pool_sha256 = "b" * 64
        return [], tmp_path / "pool", []

    monkeypatch.setattr(sp, "setup", fake_setup)
    monkeypatch.setattr(sp, "one", lambda *a: pytest.fail("no run may start"))
    (tmp_path / "tuning.json").write_text(json.dumps({"runs": [], "settings": {"pool_sha256": "a" * 64}}))
    assert sp.main(["--tune", "--out", str(tmp_path)]) == 2
    assert "was made on the pool whose adapters' sha256 is aaaaaaaaaaaaaaaa…" in capsys.readouterr().err
    assert sp.same_pool(None, "b" * 64, "x") is None and sp.same_pool("b" * 64, "b" * 64, "x") is None


def test_smartfed_tuning_resumed_keeps_every_call_and_the_pool(tmp_path, monkeypatch):
    """A tuning in parts (a session ends): the second call runs only what is missing, and tuning.json and
    the draft name both calls and the pool's sha256."""
    import smartfed_protocol as sp

    def fake_setup(args):
        args.pool_sha256 = "c" * 64
        return [], tmp_path / "pool", []

    finals = {1e-3: 33.0, 3e-3: 32.0, 1e-2: 32.5}
    ran = []

    def fake_one(args, run, pooled, arm, value, seed, split):
        ran.append((arm, value))
        return fake_smartfed_runs(split, [seed], {arm: {value: finals[value]}})[0]

    monkeypatch.setattr(sp, "setup", fake_setup)
    monkeypatch.setattr(sp, "one", fake_one)
    out = ["--tune", "--out", str(tmp_path), "--arms", "fedavg-lora"]
    assert sp.main([*out, "--grid", "fedavg-lora=1e-3,3e-3"]) == 2  # best at the edge: refused
    assert sp.main([*out]) == 0 and ran[-1] == ("fedavg-lora", 1e-2) and len(ran) == 3
    saved = json.loads((tmp_path / "tuning.json").read_text())
    assert len(saved["commands"]) == 2 and saved["settings"]["pool_sha256"] == "c" * 64
    spec = json.loads((tmp_path / "protocol.json").read_text())
    assert spec["tuning_commands"] == saved["commands"] and spec["settings"]["pool_sha256"] == "c" * 64


def test_fedala_eta_picks_eta_on_validation_reports_the_weights_range_and_refuses_an_edge(tmp_path, monkeypatch):
    """bench/fedala_eta.py with the simulation replaced by made-up runs (metrics.jsonl as FedALA writes it):
    every η runs on the validation split, the weights' range is read from the clients' metrics, the best η
    is refused at the grid's edge, and a second call to the same --out runs only the values it lacks."""
    import fedala_eta

    final = {1.0: 40.0, 10.0: 38.0, 100.0: 37.0, 1000.0: 39.0}
    calls = []

    def fake_run_one(algorithm, overrides, reuse=False):
        items = dict(o.split("=", 1) for o in overrides)
        eta = float(items["algorithm.ala.eta"])
        calls.append((algorithm, eta, items["task.eval_split"]))
        run_dir = tmp_path / "runs" / f"eta{eta:g}"
        run_dir.mkdir(parents=True)
        moved = min(1.0, 0.001 * eta)
        records = [{"round": 0, "clients": [{"eval_ala-passes": 0}]}] + [
            {"round": r, "clients": [{"eval_ala-weight-mean": 1 - moved / 2, "eval_ala-weight-min": 1 - moved,
                                      "eval_ala-weight-max": 1.0}, {"eval_ala-weight-mean": 1 - moved / 4}]}
            for r in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return {"status": "completed", "metric": "perplexity", "initial_metric": 45.0, "final_metric": final[eta],
                "run_dir": str(run_dir)}

    monkeypatch.setattr(fedala_eta, "run_one", fake_run_one)
    out = tmp_path / "out"
    assert fedala_eta.main(["--eta-grid", "1,10,100", "--out", str(out)]) == 2  # best 100: the grid's edge
    assert all(a == "fedala" and split == "val" for a, _, split in calls) and len(calls) == 3
    assert "sits at the edge" in (out / "tuning.md").read_text()
    calls.clear()
    assert fedala_eta.main(["--eta-grid", "1,10,100,1000", "--out", str(out)]) == 0
    assert [eta for _, eta, _ in calls] == [1000.0]  # the three finished values are kept
    saved = json.loads((out / "tuning.json").read_text())
    assert saved["best"]["best"] == {"algorithm.ala.eta": 100.0} and saved["refused"] is None
    by_eta = {r["eta"]: r for r in saved["runs"]}
    assert by_eta[100.0]["weights"][-1] == {"round": 2, "min": 0.9, "mean": pytest.approx(0.9625), "max": 1.0}
    text = (out / "tuning.md").read_text()
    assert "| **100** | 45.00 → **37.00** | -8.00 | 0.9000 / 0.9625 / 1.0000 | 0.9000 to 1.0000 |" in text
    assert "Best η: **100** (validation perplexity 37.00); inside the grid" in text
    assert (f"Made by `bench/fedala_eta.py --eta-grid 1,10,100 --out {out}`; then "
            f"`bench/fedala_eta.py --eta-grid 1,10,100,1000 --out {out}`") in text  # every call that added runs
    assert fedala_eta.main(["--eta-grid", "1,10,100,1000", "--out", str(out)]) == 0  # nothing to add: not a call
    assert len(json.loads((out / "tuning.json").read_text())["commands"]) == 2
    with pytest.raises(SystemExit):
        fedala_eta.main(["--eta-grid", "1,10", "--out", str(out)])  # two values cannot bracket a best


def test_smartfed_evaluation_in_parts_keeps_the_saved_runs_and_refuses_another_protocols(tmp_path, monkeypatch,
                                                                                         capsys):
    """The evaluation spans sessions (20 runs of 8-18 min): a call cut short leaves its finished runs in
    protocol-report.json with a partial report; the same command runs only what is missing and names both
    calls; a report made under another commit of the protocol is not extended."""
    import argparse

    import smartfed_protocol as sp

    tuning = fake_smartfed_runs("val", [100], {"smartfed-tuned": {1e-3: 32.0, 3e-3: 30.5, 1e-2: 31.0},
                                               "fedavg-lora": {1e-3: 31.3, 3e-3: 30.3, 1e-2: 30.9}})
    spec = sp.draft(tuning, argparse.Namespace(evaluation_seeds=[45, 46], margin=0.0),
                    {"model": "smollm2", "task": "shakespeare", "pool_sha256": "d" * 64})
    (tmp_path / "protocol.json").write_text(json.dumps(spec))
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "protocol.json")
    git(tmp_path, "commit", "-qm", "protocol")

    def fake_setup(args):
        args.pool_sha256 = "d" * 64
        return [], tmp_path / "pool", []

    ran = []

    def fake_one(args, run, pooled, arm, value, seed, split):
        if len(ran) == 3 and stop_after_three:
            raise KeyboardInterrupt  # the session's end
        ran.append((arm, seed))
        return fake_smartfed_runs(split, [seed], {arm: {value: 30.0 if arm == "smartfed-tuned" else 31.0}})[0]

    monkeypatch.setattr(sp, "setup", fake_setup)
    monkeypatch.setattr(sp, "one", fake_one)
    out = tmp_path / "out"
    argv = ["--protocol", str(tmp_path / "protocol.json"), "--out", str(out)]
    stop_after_three = True
    with pytest.raises(KeyboardInterrupt):
        sp.main(argv)
    assert ran == [("smartfed-tuned", 45), ("fedavg-lora", 45), ("smartfed-tuned", 46)]  # every arm of a seed first
    saved = json.loads((out / "protocol-report.json").read_text())
    assert len(saved["runs"]) == 3 and saved["runs_planned"] == 4
    assert "**Partial: 3 of 4 runs so far**" in (out / "protocol-report.md").read_text()
    stop_after_three = False
    assert sp.main(argv) == 0 and ran[3:] == [("fedavg-lora", 46)]  # only the missing run
    text = (out / "protocol-report.md").read_text()
    assert "Partial" not in text and "(2 calls: an evaluation in parts)" in text
    assert text.count("--protocol") == 1  # the same command resumed: named once
    assert "vs fedavg-lora: -1.00 perplexity over 2 seeds" in text
    saved = json.loads((out / "protocol-report.json").read_text())
    saved["protocol"]["commit"] = "e" * 40  # made under another commit of the protocol file
    (out / "protocol-report.json").write_text(json.dumps(saved))
    assert sp.main(argv) == 2 and len(ran) == 4
    assert "was made under the protocol committed at eeeeeeeeeeee" in capsys.readouterr().err
