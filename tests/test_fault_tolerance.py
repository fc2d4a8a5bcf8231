"""Fault tolerance without a cluster: reply collection with dead nodes, checkpoints, resume,
node config and device placement (CPU here; the CUDA branch is exercised with CUDA faked)."""

import contextlib
import json
import os
import time
import uuid

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from clients import train as train_mod
from fedapps import checkpoint as ckpt
from fedapps.config import compose
from fedapps.outputs import read_metrics
from fedapps.runner import collect_replies
from fedapps.session import ClientSetupError, node_view
from strategies.base import PayloadFedAvg
from strategies.screening import CONFIG_RECORD

STATE = {"a": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float32)}


class FakeGrid:
    """push/pull like Flower's grids; ``answer(node, request)`` -> reply, None (silent) or a delay."""

    def __init__(self, answer):
        self.answer = answer
        self.sent: dict[str, tuple[float, Message]] = {}

    def get_node_ids(self):
        return [1, 2, 3]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent[msg.metadata.message_id] = (time.time(), msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            sent_at, msg = self.sent[mid]
            result = self.answer(msg.metadata.dst_node_id, msg)
            if isinstance(result, float):
                if time.time() - sent_at < result:
                    continue
                result = ok_reply(msg)
            if result is not None:
                out.append(result)
        return out


def ok_reply(request):
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=request)


def requests():
    return [Message(RecordDict({}), dst_node_id=n, message_type="evaluate") for n in (1, 2, 3)]


def test_a_dead_node_does_not_hold_the_round_once_the_quorum_answered():
    grid = FakeGrid(lambda node, msg: None if node == 3 else ok_reply(msg))
    start = time.time()
    replies, missing = collect_replies(grid, requests(), timeout=60, quorum=2, straggler_timeout=0.3, poll=0.05)
    assert time.time() - start < 5
    assert sorted(r.metadata.reply_to_message_id for r in replies) == sorted(
        mid for mid, (_, m) in grid.sent.items() if m.metadata.dst_node_id != 3)
    assert list(missing) == [3] and "straggler_timeout" in missing[3]


def test_a_slow_node_within_the_straggler_timeout_is_waited_for():
    grid = FakeGrid(lambda node, msg: 0.3 if node == 3 else ok_reply(msg))
    replies, missing = collect_replies(grid, requests(), timeout=60, quorum=2, straggler_timeout=5, poll=0.05)
    assert len(replies) == 3 and not missing


def test_flower_node_unavailable_errors_name_the_dead_node_and_are_not_replies():
    def answer(node, msg):
        if node == 2:
            return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=msg)
        return ok_reply(msg)

    replies, missing = collect_replies(FakeGrid(answer), requests(), timeout=60, poll=0.05)
    assert len(replies) == 2 and list(missing) == [2] and "Node Unavailable" in missing[2]


def test_without_a_quorum_the_round_waits_until_the_timeout():
    grid = FakeGrid(lambda node, msg: None if node != 1 else ok_reply(msg))
    replies, missing = collect_replies(grid, requests(), timeout=0.3, quorum=None, straggler_timeout=0.0, poll=0.05)
    assert len(replies) == 1 and set(missing) == {2, 3} and "strategy.timeout" in missing[2]


def test_missing_nodes_are_recorded_and_get_the_config_again(caplog):
    records = []
    strategy = PayloadFedAvg(initial_state=STATE, config_yaml="a: 1\n", num_clients=3, on_round_end=records.append)
    first = strategy.configure_evaluate(1, strategy.downlink_arrays(), ConfigRecord(), FakeGrid(None))
    assert all(CONFIG_RECORD in m.content.config_records for m in first)
    strategy.record_missing(1, 3, "evaluate", "no reply")
    strategy.aggregate_evaluate(1, [])
    assert records[0]["missing"] == [{"node_id": 3, "phase": "evaluate", "reason": "no reply"}]
    assert "no evaluate reply from node 3" in caplog.text
    assert strategy.downlink.configured == {1, 2}


def test_strategy_state_round_trips_and_refuses_another_layout():
    strategy = PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=2)
    strategy.global_state["a"] += 2.5
    strategy.history.append({"round": 0, "eval": {}, "clients": [], "refused": [], "missing": []})
    arrays, meta = strategy.state_dict()
    fresh = PayloadFedAvg(initial_state=STATE, config_yaml="", num_clients=2)
    fresh.downlink.configured.add(5)
    fresh.load_state_dict(arrays, json.loads(json.dumps(meta)))
    assert np.array_equal(fresh.global_state["a"], strategy.global_state["a"]) and fresh.history == strategy.history
    assert fresh.downlink.configured == set()
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({"a": np.ones((3, 3)), "b": np.zeros(4)}, meta)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"a": np.ones((2, 3))}, meta)


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_is_written_atomically_and_reads_back(tmp_path):
    cfg = compose(preset="test")
    ckpt.save(tmp_path, server_round=2, cfg=cfg, arrays=STATE, meta={"history": [{"round": 0}]})
    assert [p.name for p in tmp_path.iterdir()] == [ckpt.CHECKPOINT]  # no temporary file left
    back = ckpt.load(tmp_path)
    assert back.round == 2 and back.meta == {"history": [{"round": 0}]}
    assert all(np.array_equal(back.arrays[k], v) for k, v in STATE.items())
    ckpt.check_compatible(back, cfg)
    with pytest.raises(ckpt.ResumeError, match="algorithm.name: 'fedavg-lora' in the checkpoint, 'fedprox' now"):
        ckpt.check_compatible(back, compose(preset="test", algorithm="fedprox"))
    (tmp_path / ckpt.CHECKPOINT).write_bytes(b"not a zip")
    with pytest.raises(ckpt.ResumeError, match="not a readable"):
        ckpt.load(tmp_path)


def test_resume_requests(tmp_path):
    out = f"output_dir={tmp_path}"
    assert ckpt.resume_folder(compose([out], preset="test")) == (None, False)
    assert ckpt.resume_folder(compose([out, "run_name=exp", "resume=auto"], preset="test")) == (tmp_path / "exp", False)
    assert ckpt.resume_folder(compose([out, "run_name=exp", "resume=true"], preset="test")) == (tmp_path / "exp", False)
    with pytest.raises(ckpt.ResumeError, match="needs a fixed run_name"):
        ckpt.resume_folder(compose([out, "resume=auto"], preset="test"))
    with pytest.raises(ckpt.ResumeError, match="does not exist"):
        ckpt.resume_folder(compose([out, f"resume={tmp_path}/nothing"], preset="test"))
    (tmp_path / "exp").mkdir()
    ckpt.save(tmp_path / "exp", server_round=0, cfg=compose(preset="test"), arrays=STATE, meta={})
    assert ckpt.resume_folder(compose([out, f"resume={tmp_path}/exp"], preset="test")) == (tmp_path / "exp", True)


# ---------------------------------------------------------------------------- node config
def context(**node_config):
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def test_node_config_sets_model_path_device_and_data_path(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTCARD_CACHE", "/somewhere/else")
    cfg = compose(preset="test")
    assert node_view(cfg, context(**{"partition-id": 0})) is cfg
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    view = node_view(cfg, context(**{"partition-id": 0, "model-path": str(tmp_path / "ckpt"), "device": "cpu",
                                     "data-path": str(tmp_path / "data")}))
    assert view.model.path == str(tmp_path / "ckpt") and view.train.device == "cpu"
    assert cfg.model.path is None and cfg.train.device == "auto"  # the run's config is untouched
    assert os.environ["POSTCARD_CACHE"] == str(tmp_path / "data") and (tmp_path / "data").is_dir()
    with pytest.raises(ClientSetupError, match="not a HF checkpoint folder"):
        node_view(cfg, context(**{"model-path": str(tmp_path)}))
    vision = compose(["model=tiny-cnn"], task="fmnist", algorithm="fedavg-full")
    with pytest.raises(ClientSetupError, match="applies to causal LMs"):
        node_view(vision, context(**{"model-path": str(tmp_path / "ckpt")}))


# ---------------------------------------------------------------------------- devices
def test_device_selection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_mod.select_device("auto") == torch.device("cpu")
    assert train_mod.select_device(None) == torch.device("cpu")
    with pytest.raises(train_mod.TrainingError, match="sees no CUDA device"):
        train_mod.select_device("cuda")
    with pytest.raises(train_mod.TrainingError, match="unknown device"):
        train_mod.select_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert train_mod.select_device("auto") == torch.device("cuda")
    assert train_mod.select_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(train_mod.TrainingError, match="does not exist"):
        train_mod.select_device("cuda:2")


def test_cpu_placement_leaves_model_and_task_untouched():
    model = torch.nn.Linear(3, 2)

    class Task:
        def collate(self, indices):
            return {"x": torch.zeros(len(indices), 3)}

    task = Task()
    assert train_mod.place_model(model, torch.device("cpu")) is model
    assert not hasattr(model, train_mod.AUTOCAST_ATTR)
    assert train_mod.place_task(task, torch.device("cpu")) is task and "collate" not in vars(task)
    assert isinstance(train_mod.autocast(model), contextlib.nullcontext)


def test_batches_follow_the_task_to_its_device():
    class Task:
        def collate(self, indices):
            return {"x": torch.zeros(len(indices), 3), "y": [torch.ones(1)], "n": 3}

    task = train_mod.place_task(Task(), torch.device("meta"))
    batch = task.collate([0, 1])
    assert batch["x"].device.type == "meta" and batch["y"][0].device.type == "meta" and batch["n"] == 3


def test_bf16_autocast_is_used_for_a_model_marked_on_cuda(monkeypatch):
    """The CUDA branch without a GPU: a model 'on cuda' gets torch.autocast(cuda, bfloat16)."""
    model = torch.nn.Linear(3, 2)
    setattr(model, train_mod.AUTOCAST_ATTR, torch.bfloat16)
    monkeypatch.setattr(train_mod, "model_device", lambda m: torch.device("cuda"))
    seen = {}

    class FakeAutocast:
        def __init__(self, device_type, dtype):
            seen.update(device_type=device_type, dtype=dtype)

    monkeypatch.setattr(torch, "autocast", FakeAutocast)
    train_mod.autocast(model)
    assert seen == {"device_type": "cuda", "dtype": torch.bfloat16}


def test_a_run_resumes_after_its_last_checkpoint(outputs):
    """Run 1 round, then the same run_name with rounds=2 and resume=auto: only round 2 runs.
    (#40: run_server in this process, inprocess.run, not two Ray simulations: a few seconds, no longer
    marked slow. Resume through Flower, after a killed SuperLink: test_deploy's faults test.)"""
    from inprocess import run as simulate

    first = simulate(compose(["rounds=1", "train.local_steps=2", "run_name=exp", "resume=auto"], preset="test"))
    assert ckpt.load(first["run_dir"]).round == 1 and "resumed_after_round" not in first
    second = simulate(compose(["rounds=2", "train.local_steps=2", "run_name=exp", "resume=auto"], preset="test"))
    assert second["run_dir"] == first["run_dir"] and second["resumed_after_round"] == 1
    rounds = read_metrics(second["run_dir"])
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert ckpt.load(second["run_dir"]).round == 2
    assert second["metric_by_round"]["1"] == first["metric_by_round"]["1"]  # round 1 kept, not redone


def test_the_server_runs_numpy_blas_on_one_thread_and_gives_the_pool_back(tmp_path):
    """A server thread once spun for good in OpenBLAS's thread pool (fedapps.runner.numpy_blas_single_thread):
    while a run's server works, numpy's OpenBLAS has no pool to wait on; after it, the caller's setting is back."""
    from threadpoolctl import ThreadpoolController

    from fedapps.runner import run_server

    def openblas_threads() -> list[int]:
        return [lib.num_threads for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers]

    seen: list[list[int]] = []

    class WatchingGrid(FakeGrid):
        def push_messages(self, messages):
            seen.append(openblas_threads())
            raise RuntimeError("stop here")

    cfg = compose([f"output_dir={tmp_path}", "num_clients=3", "strategy.node_wait=1"], preset="test")
    with ThreadpoolController().select(internal_api="openblas").limit(limits=2):
        assert openblas_threads() and set(openblas_threads()) == {2}
        with pytest.raises(RuntimeError, match="stop here"):
            run_server(WatchingGrid(None), cfg)
        assert seen and set(seen[0]) == {1}
        assert set(openblas_threads()) == {2}


def test_a_failed_run_is_marked_failed_and_one_that_cannot_start_leaves_no_folder(tmp_path):
    from fedapps.runner import run_server
    from clients.pool import PoolError

    class BrokenGrid(FakeGrid):
        def push_messages(self, messages):
            raise RuntimeError("the SuperLink went away")

    cfg = compose([f"output_dir={tmp_path}", "num_clients=3", "strategy.node_wait=1"], preset="test")
    with pytest.raises(RuntimeError, match="went away"):
        run_server(BrokenGrid(None), cfg)
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "the SuperLink went away" in summary["error"]
    assert (run / "config.yaml").is_file()

    nowhere = compose([f"output_dir={tmp_path / 'smartfed'}", "num_clients=3", f"algorithm.pool={tmp_path / 'none'}"],
                      algorithm="smartfed", preset="test")
    with pytest.raises(PoolError, match="no knowledge pool"):
        run_server(FakeGrid(None), nowhere)
    assert not (tmp_path / "smartfed").exists()


def test_one_client_count_too_many_or_too_few_supernodes_are_refused_at_once(tmp_path):
    """num_clients (else the task's default_clients) is the run's client count under flwr run and
    postcard alike; a different number of SuperNodes is refused with the fix, and no folder made."""
    from fedapps.resolved import client_count
    from fedapps.runner import ServerSetupError, run_server

    assert client_count(compose(task="mmlu")) == 5 and client_count(compose(preset="test")) == 2
    grid = FakeGrid(None)  # three SuperNodes
    too_many = compose([f"output_dir={tmp_path}", "num_clients=2"], preset="test")
    with pytest.raises(ServerSetupError, match="3 SuperNodes are connected but the run has num_clients=2"):
        run_server(grid, too_many)
    start = time.time()
    too_few = compose([f"output_dir={tmp_path}", "num_clients=5", "strategy.node_settle=1"], preset="test")
    with pytest.raises(ServerSetupError, match=r"3 SuperNode\(s\) connected and no more for 1 s, but the run has "
                                               r"num_clients=5: .*num-supernodes=N.*num_clients=3"):
        run_server(grid, too_few)
    assert time.time() - start < 10  # not strategy.node_wait (120 s)
    assert not any(tmp_path.iterdir())
