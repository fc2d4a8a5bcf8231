"""bench/onboarding.py's arithmetic: rounds and bytes to a target, seeds that never reach it, the paired difference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import onboarding  # noqa: E402
from conftest import SMARTFED_SOURCES  # noqa: E402


def run(ppl, per_round):
    return {"metric_by_round": {str(r): v for r, v in enumerate(ppl)},
            "cumulative_uplink_bytes": {str(r): r * per_round for r in range(len(ppl))},
            "uplink_bytes_per_client_round": per_round}


def results(targets=None):
    seeds = {"42": {"fedavg-lora": run([60, 45, 38, 34], 1000), "smartfed": run([48, 41, 39, 36], 300)},
             "43": {"fedavg-lora": run([60, 47, 40, 35], 1000), "smartfed": run([49, 44, 43, 43], 300)}}
    return {"metric": "perplexity", "seeds": seeds, "rounds": 3, "clients": 2, "steps": 1, "lr": 1e-3,
            "target": "shakespeare", "model": "tiny", "command": "x", "date": "d", "wall_minutes": 1.0,
            "pool": "p", "pool_adapters": ["a"], "target_data": "{}",
            "targets": targets or onboarding.default_targets(seeds, 3)}


def test_rounds_and_bytes_to_a_target():
    assert onboarding.reaching(run([60, 45, 38, 34], 1000), 40, higher=False) == (2, 2000)
    assert onboarding.reaching(run([60, 45, 38, 34], 1000), 30, higher=False) == (None, None)
    assert onboarding.reaching(run([0.2, 0.5], 10), 0.4, higher=True) == (1, 10)
    # round 0 never counts: the target is something training reaches
    assert onboarding.reaching(run([30, 45], 10), 40, higher=False) == (None, None)


def test_default_target_is_fedavg_loras_mean_halfway():
    assert results()["targets"] == [pytest.approx((45 + 47) / 2)]


def test_report_counts_unreached_seeds_and_pairs_only_seeds_both_reached():
    text = onboarding.report(results(targets=[42.0]))
    # fedavg-lora reaches 42 in round 2 with both seeds; smartfed in round 1 (seed 42) and never (seed 43)
    assert "| rounds | 2.0 ± 0.0 (2/2 seeds reached it) | 1.0 (1/2 seeds reached it) | -1.0 (n = 1) |" in text
    assert "| uplink bytes per client | 2,000 ± 0 (2/2 seeds reached it) | 300 (1/2 seeds reached it) " \
           "| -1,700 (n = 1) |" in text
    assert onboarding.mean_interval([1.0, 3.0]) == (2.0, pytest.approx(12.706204736, rel=1e-6))


@pytest.mark.slow
def test_the_onboarding_recipe_runs_end_to_end_on_a_tiny_model(tmp_path, tiny_llama_pool):
    """The recipe of docs/smartfed.md, automated: a pool filled by a LoRA run on other plays
    (`postcard pool build` = `pool add` of finished runs), then the new plays learned by
    SmartFed from that pool and by FedAvg-LoRA from scratch; a pool holding the target's
    plays is refused before anything trains. The pool is a copy of the session's
    (conftest.tiny_llama_pool, built by `postcard pool build`), which holds the two sources asked for:
    the recipe's build step finds it pooled and trains nothing (#40: one Ray run fewer)."""
    import json
    import shutil

    out, runs, pool = tmp_path / "report", tmp_path / "runs", tmp_path / "pool"
    shutil.copytree(tiny_llama_pool[0], pool)
    tiny = ["--model", "tiny-llama", "--seeds", "1", "--rounds", "1", "--steps", "2", "--eval-batches", "1",
            "--pool-sources", ",".join(SMARTFED_SOURCES), "--pool-rounds", "1", "--pool-steps", "1",
            "--pool", str(pool), "--runs-dir", str(runs)]
    assert onboarding.main([*tiny, "--out", str(out)]) == 0
    result = json.loads((out / "onboarding.json").read_text())
    assert sorted(result["pool_adapters"]) == sorted(SMARTFED_SOURCES) and result["metric"] == "perplexity"
    assert not [p for p in runs.iterdir() if "onboarding" not in p.name]  # the pool's sources not built again
    runs_42 = result["seeds"]["42"]
    for method in ("fedavg-lora", "smartfed"):
        assert sorted(runs_42[method]["metric_by_round"], key=int) == ["0", "1"]
        assert all(v > 0 for v in runs_42[method]["metric_by_round"].values())
    assert runs_42["smartfed"]["uplink_bytes_per_client_round"] < runs_42["fedavg-lora"]["uplink_bytes_per_client_round"]
    assert "| rounds |" in (out / "onboarding.md").read_text() and (out / "onboarding.png").stat().st_size > 0

    # an interrupted part is continued: the completed runs of the same configuration are read, not run again
    assert onboarding.main([*tiny, "--reuse-runs", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "onboarding.json").read_text())["seeds"]["42"]
    for method in ("fedavg-lora", "smartfed"):
        assert again[method]["reused"] and again[method]["run_dir"] == runs_42[method]["run_dir"]
        assert again[method]["metric_by_round"] == runs_42[method]["metric_by_round"]
    assert "not run again: fedavg-lora seed 42" in (tmp_path / "again" / "onboarding.md").read_text()

    # the same pool, but the new clients' plays are the pooled adapter's: refused
    with pytest.raises(SystemExit, match="shakespeare-histories.*henry-v"):
        onboarding.main([*tiny, "--out", str(tmp_path / "refused"), "--", "task.plays=[henry-v,king-john]"])


def test_parts_merge_into_one_benchmark_and_other_protocols_are_refused():
    a, b = results(), results()
    a["seeds"] = {"42": a["seeds"]["42"]}
    b["seeds"] = {"43": b["seeds"]["43"]}
    a["command"], b["command"] = "part 42", "part 43"
    merged = onboarding.merge([a, b])
    assert list(merged["seeds"]) == ["42", "43"] and merged["command"] == "part 42; part 43"
    assert merged["targets"] == onboarding.default_targets(results()["seeds"], 3)  # over both seeds' runs
    text = onboarding.report(merged)
    # round 3, paired over the two seeds: smartfed − fedavg-lora = 36 − 34 and 43 − 35 -> 5 ± 38.12
    assert "| 3 | 34.50 ± 6.35 | 39.50 ± 44.47 | 5.00 ± 38.12 |" in text
    b["rounds"] = 8
    with pytest.raises(SystemExit, match="rounds"):
        onboarding.merge([a, b])
    b["rounds"] = 3  # a SmartFed variant is another benchmark; a part from before the option has none
    b["smartfed_overrides"] = "algorithm.importance=sensitivity"
    with pytest.raises(SystemExit, match="smartfed_overrides"):
        onboarding.merge([a, b])
    b["smartfed_overrides"] = ""
    assert list(onboarding.merge([a, b])["seeds"]) == ["42", "43"]


def test_reference_reports_give_each_method_only_where_its_overrides_match(tmp_path):
    """--reference-from: a report of the same protocol gives a method's per-seed results where it ran
    that method with this run's overrides for it (a SmartFed variant reads FedAvg-LoRA's runs; a tuned
    FedAvg-LoRA reads the variant's SmartFed runs); another protocol is refused by name."""
    import json

    base = results()
    base["smartfed_overrides"] = "algorithm.lr.experts=3e-3"  # fedavg_lora_overrides absent: an older report
    path = tmp_path / "onboarding.json"
    path.write_text(json.dumps(base))
    protocol = {k: base[k] for k in ("model", "target", "target_data", "rounds", "clients", "steps", "lr",
                                     "pool_adapters")}
    variant = onboarding.references([str(path)], protocol, {"fedavg-lora": "", "smartfed": "algorithm.top_k=4"})
    assert set(variant) == {"42", "43"} and all(set(v) == {"fedavg-lora"} for v in variant.values())
    assert variant["43"]["fedavg-lora"]["metric_by_round"] == base["seeds"]["43"]["fedavg-lora"]["metric_by_round"]
    assert variant["42"]["fedavg-lora"]["reference_report"] == str(path)
    tuned = onboarding.references([str(path)], protocol,
                                  {"fedavg-lora": "train.lr=3e-3", "smartfed": "algorithm.lr.experts=3e-3"})
    assert all(set(v) == {"smartfed"} for v in tuned.values())
    text = onboarding.report({**base, "seeds": {s: {**base["seeds"][s], **tuned[s]} for s in tuned},
                              "fedavg_lora_overrides": "train.lr=3e-3"})
    assert "not run again: smartfed seed 42" in text and "FedAvg-LoRA with `train.lr=3e-3`" in text
    with pytest.raises(SystemExit, match=r"rounds=3, not 8"):
        onboarding.references([str(path)], {**protocol, "rounds": 8}, {"fedavg-lora": "", "smartfed": ""})


def test_merge_of_a_missing_part_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        onboarding.main(["--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "missing.json" in capsys.readouterr().err


def test_only_a_completed_run_of_exactly_this_configuration_is_reused(tmp_path):
    import json

    from fedapps.config import compose, to_yaml
    from smartfed import finished_run

    cfg = compose(["model=tiny-llama", f"output_dir={tmp_path}", "run_name=part-s42", "rounds=2"],
                  algorithm="fedavg-lora")

    def folder(name, config, status):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(config)
        (tmp_path / name / "summary.json").write_text(json.dumps({"status": status, "run_dir": name}))

    assert finished_run(cfg) is None
    folder("part-s42", to_yaml(cfg), "failed")                                         # crashed
    folder("part-s42-2", to_yaml(compose(["model=tiny-llama", f"output_dir={tmp_path}", "run_name=part-s42",
                                          "rounds=3"], algorithm="fedavg-lora")), "completed")  # other protocol
    folder("part-s420", to_yaml(cfg), "completed")                                     # another run's name
    assert finished_run(cfg) is None
    folder("part-s42-3", to_yaml(cfg), "completed")
    assert finished_run(cfg)["run_dir"] == "part-s42-3"


def test_a_run_from_before_an_option_existed_is_reused_unless_the_option_is_set(tmp_path):
    import json

    import yaml
    from fedapps.config import compose, to_yaml
    from smartfed import finished_run

    overrides = ["model=tiny-llama", f"output_dir={tmp_path}", "run_name=old-s42"]
    cfg = compose(overrides, algorithm="fedavg-lora")
    older = yaml.safe_load(to_yaml(cfg))
    del older["strategy"]["server_optimizer"]  # a run made before strategy.server_optimizer existed
    (tmp_path / "old-s42").mkdir()
    (tmp_path / "old-s42" / "config.yaml").write_text(yaml.safe_dump(older))
    (tmp_path / "old-s42" / "summary.json").write_text(json.dumps({"status": "completed", "run_dir": "old-s42"}))
    assert finished_run(cfg, overrides)["run_dir"] == "old-s42"
    adam = [*overrides, "strategy.server_optimizer.name=fedadam"]
    assert finished_run(compose(adam, algorithm="fedavg-lora"), adam) is None  # the new option is in use
    assert finished_run(compose([*overrides, "train.lr=0.5"], algorithm="fedavg-lora")) is None  # an old key differs


def test_equal_bytes_pairs_each_seed_with_smartfeds_last_round_within_fedavg_loras_bytes():
    runs = results()["seeds"]["42"]  # fedavg-lora 1,000 B a round, smartfed 300 B a round, 3 rounds
    assert onboarding.within_bytes(runs, 1) == 3  # 900 B <= 1,000 B
    assert onboarding.within_bytes(runs, 2) is None  # smartfed's 3 rounds sent 900 B < 2,000 B: cut short
    text = onboarding.report(results(targets=[42.0]))
    # round 1 of fedavg-lora (45, 47) against smartfed's round 3 (36, 43): paired −9 and −4
    assert "| 1 | 1,000 | 46.00 ± 12.71 | 39.50 ± 44.47 (3, 3) | -6.50 ± 31.77 |" in text
    assert "| 2 | 2,000 |" not in text


def test_quick_puts_its_settings_first_and_keeps_the_report_out_of_docs():
    import smartfed

    argv = smartfed.quick_argv(["--quick", "--rounds", "3"], "bench-onboarding-quick", ("--seeds", "1"))
    assert argv[:len(smartfed.QUICK)] == list(smartfed.QUICK) and argv[-3:] == ["--quick", "--rounds", "3"]
    assert argv[argv.index("--out") + 1] == str(ROOT / "outputs" / "bench-onboarding-quick")
    assert argv[argv.index("--seeds") + 1] == "1"
    assert "--out" not in smartfed.quick_argv(["--quick", "--out=/tmp/x"], "q")[:-2]
    assert smartfed.quick_argv(["--rounds", "3"], "q") == ["--rounds", "3"]  # without --quick: untouched
