"""The server side at 10,000 registered nodes (issue #63, item 2): does a round's time and memory follow
the clients it samples, or the clients registered?

    .venv/bin/python bench/scale_server.py            # 1,000 and 10,000 registered, 100 sampled, 5 rounds
    .venv/bin/python bench/scale_server.py --quick    # 100 and 1,000 registered, 2 rounds (seconds)
    .venv/bin/python bench/scale_server.py --registered 1000 10000 100000 --strategies flite fedavg-lora

No training and no Flower runtime: the server's own code, driven with fake client replies. Per
registered count N (each in a fresh ``python bench/scale_server.py --one N ...`` process, so that
resident memory compares), a fake grid holds N node ids and answers every message it is pushed at
once; rounds 0..R run as ``fedapps.runner._run_rounds`` runs them (:func:`drive_round` is its loop
body, with the runner's own ``_Rounds``: ``ensure_nodes``, ``collect_replies`` with its packing, the
missing-node bookkeeping):

    ensure_nodes -> configure_train (Flower's sampling: fraction_train = sampled / N) -> push, pull
      -> aggregate_train -> ensure_nodes -> configure_evaluate -> push, pull -> aggregate_evaluate
      (the round record: the ledger's on_round_end -> RunDir.write_round, metrics.jsonl) -> checkpoint
      (fedapps.checkpoint.save: checkpoint.npz, written atomically, fsync'd)

Strategies (``--strategies``): ``flite`` — :class:`strategies.flite.FliteStrategy` over 1,280 latents,
int4 uplink, fp32 downlink, as ``tests/hostile.py``'s ``flite`` spec builds it; a fake client answers
with a small random int4 update of z, its metrics and the fingerprint record; ``fedavg-lora`` —
:class:`strategies.baselines.FedAvgLoRA` over 16 LoRA factors (4 layers × q, v × A, B; rank 8,
width 256: 32,768 fp32 values), absolute fp32 uplink; a fake client unpacks the downlink, adds small
noise and packs its reply as ``fedapps.client_app``'s mod does. Evaluation replies carry metrics only.

Grids (``--grids``): ``wire`` (default) — what Flower 1.42's ``HttpGrid`` does in the ServerApp's
process, without the network: ``get_node_ids`` parses a ``GetNodesResponse`` of N ``NodeInfo``
records (the SuperLink's answer: id, owner, status, timestamps, heartbeat, a 120-byte public key),
``push_messages`` names each message by its ``object_id`` and deflates its objects, ``pull_messages``
inflates each reply from the objects its client deflated; ``plain`` — ``get_node_ids`` returns a new
list of N ints and messages stay in memory (the strategy's own share alone).

Measured per round (rounds 1..R; round 0, the initial evaluation, is recorded apart): the server's
wall and CPU seconds — the round's whole time less what the fake clients spent building,
encoding and deflating their replies (reported beside it) —, by phase, and the process's resident
memory after the round (``VmRSS``, after ``gc.collect()``) and its peak (``VmHWM``); beside them
what could grow with N: ``get_node_ids`` calls and ids read, the seconds spent reading the node
list, ``configured_nodes`` (the nodes that have been sent the run's config), the checkpoint's and
the round record's bytes, first-contact messages (those carrying the run's YAML). The report (``OUT/
scale-server.md`` and ``.json``) gives per N the median and max over rounds (and ``--repeat``
processes) and the ratio of each N to the first, with the per-registered-node slope.

The SuperLink's side (``--superlink``, another process, so not in those seconds): each ``get_node_ids``
of ``HttpGrid`` is a ``GetNodes`` call that the SuperLink answers from its LinkState with every
registered node's record; :func:`superlink_get_nodes` times Flower's own handler on N online nodes in
a SQLite ``state.db`` and in the in-memory LinkState, and the report multiplies it by the calls a round
makes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

STRATEGIES = ("flite", "fedavg-lora")
GRIDS = ("wire", "plain")
LATENTS = 1280
LORA = {f"base_model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight": (8, 256) if ab == "A" else (256, 8)
        for i in range(4) for p in ("q_proj", "v_proj") for ab in "AB"}
FINGERPRINT = "abcd" * 4
PHASES = ("configure_train", "train_exchange", "aggregate_train", "configure_evaluate", "eval_exchange",
          "aggregate_evaluate", "checkpoint")
TARGET = 1.2  # issue #63: 10,000 registered within 1.2x of 1,000, seconds and memory per round


def task_identity() -> None:
    """Messages built outside a Flower run need a run/node identity (the ServerApp's)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def rss() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb = line.split()[:2]
                values[key[:-1]] = int(kb) / 1024
    return values["VmRSS"], values["VmHWM"]


# ------------------------------------------------------------------------------ the fake grid
def node_ids(n: int, seed: int = 0) -> list[int]:
    """N distinct random 63-bit node ids (as the SuperLink draws them)."""
    rng = np.random.default_rng(seed)
    ids: set[int] = set()
    while len(ids) < n:
        ids.update(int(v) for v in rng.integers(1, 2**63 - 1, size=n - len(ids) + 16, dtype=np.int64))
    return sorted(ids)[:n]


def nodes_response(ids: list[int]) -> bytes:
    """The SuperLink's serialised ``GetNodesResponse`` for ``ids`` (what ``HttpGrid.get_nodes`` parses)."""
    from flwr.proto.node_pb2 import NodeInfo
    from flwr.proto.runtime_pb2 import GetNodesResponse

    rng = np.random.default_rng(1)
    nodes = [NodeInfo(node_id=i, owner_aid=f"aid-{i % 997:06d}", owner_name="postcard-fleet", status="online",
                      registered_at="2026-11-30T09:14:07.123456+00:00",
                      last_activated_at="2026-12-01T10:00:00.000000+00:00", online_until=1796586317.0 + i % 60,
                      heartbeat_interval=30.0, public_key=rng.bytes(120), name=f"node-{k}")
             for k, i in enumerate(ids)]
    return GetNodesResponse(nodes=nodes).SerializeToString()


class FakeGrid:
    """N registered nodes; every pushed message is answered at once by ``answer(request) -> reply``.

    ``wire=True``: the ServerApp's side of Flower's ``HttpGrid`` (module docstring); the clients' work
    (building, encoding, deflating their replies) is timed apart in ``client_seconds``/``client_cpu``."""

    def __init__(self, ids: list[int], answer, *, wire: bool = True) -> None:
        self.ids = list(ids)
        self.answer = answer
        self.wire = wire
        self.blob = nodes_response(self.ids) if wire else b""
        self.pending: dict[str, object] = {}
        self.calls = 0  # get_node_ids calls
        self.ids_read = 0
        self.list_seconds = 0.0  # spent in get_node_ids
        self.client_seconds = 0.0
        self.client_cpu = 0.0
        self.pushed = 0
        self.first_contact = 0  # pushed messages carrying the run's YAML (a node's first message of the run)

    def get_node_ids(self) -> list[int]:
        t = time.perf_counter()
        if self.wire:
            from flwr.proto.runtime_pb2 import GetNodesResponse

            res = GetNodesResponse()
            res.ParseFromString(self.blob)
            ids = [node.node_id for node in res.nodes]
        else:
            ids = list(self.ids)
        self.calls += 1
        self.ids_read += len(ids)
        self.list_seconds += time.perf_counter() - t
        return ids

    def push_messages(self, messages) -> list[str]:
        from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

        from strategies.screening import CONFIG_RECORD

        messages = list(messages)
        if self.wire:  # HttpGrid.push_messages: ids from the content, every object deflated once
            with no_object_id_recompute():
                objects: dict = {}
                for msg in messages:
                    msg.metadata.__dict__["_message_id"] = msg.object_id
                    objects.update(get_all_nested_objects(msg))
                sent = {oid: obj.deflate() for oid, obj in objects.items()}
            del sent  # on the SuperLink now
        else:
            for msg in messages:
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        ids = []
        for msg in messages:
            self.pushed += 1
            if CONFIG_RECORD in msg.content.config_records:  # packing leaves config records as they are
                self.first_contact += 1
            t, c = time.perf_counter(), time.process_time()
            reply = self.answer(msg)
            if self.wire:  # the node names its reply and deflates it; the ServerApp will inflate it
                reply.metadata.__dict__["_message_id"] = reply.object_id
                reply = (reply.metadata.message_id,
                         {oid: obj.deflate() for oid, obj in get_all_nested_objects(reply).items()})
            self.client_seconds += time.perf_counter() - t
            self.client_cpu += time.process_time() - c
            self.pending[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids) -> list:
        from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

        out = []
        for mid in list(message_ids):
            reply = self.pending.pop(mid, None)
            if reply is None:
                continue
            if self.wire:  # HttpGrid.pull_messages: the reply inflated from its objects
                reply_id, contents = reply
                reply = inflate_object_from_contents(reply_id, contents)
                reply.metadata.__dict__["_message_id"] = reply_id
            out.append(reply)
        return out


# ------------------------------------------------------------------------------ fake clients
def fake_client(kind: str, seed: int = 0):
    """``answer(request) -> reply``: an honest client of ``kind`` (no model: small random updates)."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from strategies import codec, packing
    from strategies.flite import FINGERPRINT_KEY, FINGERPRINT_RECORD

    counter = [0]

    def answer(request):
        counter[0] += 1
        node = int(request.metadata.dst_node_id)
        rng = np.random.default_rng([seed, counter[0], node % 2**32])
        content = packing.unpack(request.content)
        examples = int(rng.integers(20, 60))
        if request.metadata.message_type == "evaluate":
            metrics = {"num-examples": examples, "loss": float(2.0 + rng.random()),
                       "perplexity": float(7.0 + rng.random())}
            return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=request)
        metrics = {"num-examples": examples, "loss": float(2.0 + rng.random()), "partition-id": node % 100_000,
                   "seconds": 1.0, "client-seconds": 1.5}
        reply = RecordDict({"metrics": MetricRecord(metrics)})
        if kind == "flite":
            reply["arrays"] = codec.encode({"z": (0.01 * rng.standard_normal(LATENTS)).astype(np.float32)}, "int4",
                                           rng=rng)
            reply[FINGERPRINT_RECORD] = ConfigRecord({"fingerprint": content["config"][FINGERPRINT_KEY]})
        else:
            received = codec.decode(content["arrays"])
            reply["arrays"] = codec.encode({k: v + (0.001 * rng.standard_normal(v.shape)).astype(np.float32)
                                            for k, v in received.items()})
            reply = packing.pack(reply)
        return Message(reply, reply_to=request)

    return answer


# ------------------------------------------------------------------------------ the server
@functools.cache
def _base_config(kind: str):
    from fedapps.config import compose

    return compose(["run_name=scale", "rounds=1"], preset="test",
                   algorithm="flite" if kind == "flite" else "fedavg-lora")


def config(kind: str, registered: int, sampled: int, rounds: int, output_dir: Path):
    """The run's configuration (preset ``test``): what RunDir and the checkpoint record, the YAML sent once per node."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(_base_config(kind), resolve=True))
    cfg.num_clients = registered
    cfg.rounds = rounds
    cfg.output_dir = str(output_dir)
    cfg.run_name = f"scale-{kind}-{registered}"
    cfg.strategy.fraction_train = cfg.strategy.fraction_evaluate = fraction(registered, sampled)
    OmegaConf.set_struct(cfg, True)
    return cfg


def fraction(registered: int, sampled: int) -> float:
    """The fraction of N for which Flower's sampling (``strategies.release.sample_size``) gives ``sampled``."""
    from strategies.release import sample_size

    if not 2 <= sampled <= registered:
        raise ValueError(f"sampled must be 2..{registered} (registered), got {sampled}")
    for value in (sampled / registered, (sampled + 0.5) / registered):
        if sample_size(registered, value) == sampled:
            return value
    raise ValueError(f"no fraction of {registered} samples exactly {sampled}")  # pragma: no cover


def build_strategy(kind: str, cfg, on_round_end):
    from fedapps.config import to_yaml
    from strategies.baselines import FedAvgLoRA
    from strategies.flite import FliteStrategy

    common = dict(config_yaml=to_yaml(cfg), num_clients=int(cfg.num_clients),
                  fraction_train=float(cfg.strategy.fraction_train),
                  fraction_evaluate=float(cfg.strategy.fraction_evaluate), on_round_end=on_round_end)
    if kind == "flite":
        return FliteStrategy(fingerprint=FINGERPRINT, initial_state={"z": np.zeros(LATENTS, np.float32)},
                             uplink_format="int4", downlink_format="fp32", **common)
    if kind == "fedavg-lora":
        rng = np.random.default_rng(0)
        state = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in LORA.items()}
        return FedAvgLoRA(initial_state=state, **common)
    raise ValueError(f"unknown strategy {kind!r}; choose one of {list(STRATEGIES)}")


@dataclass
class Server:
    """One server: its config, strategy, run folder, the runner's rounds and the fake grid."""

    kind: str
    cfg: object
    strategy: object
    out: object
    rounds: object
    grid: FakeGrid

    def save_checkpoint(self, server_round: int) -> None:  # fedapps.runner._run_rounds.save_checkpoint
        from fedapps import checkpoint as ckpt

        arrays, meta = self.strategy.state_dict()
        ckpt.save(self.out.path, server_round=server_round, cfg=self.cfg, arrays=arrays, meta=meta)


def build_server(kind: str, registered: int, sampled: int, rounds: int, output_dir: Path, *, grid: str = "wire",
                 seed: int = 0) -> Server:
    from fedapps.outputs import RunDir
    from fedapps.runner import _Rounds

    cfg = config(kind, registered, sampled, rounds, output_dir)
    holder: dict = {}
    strategy = build_strategy(kind, cfg, on_round_end=lambda record: holder["out"].write_round(record))
    out = RunDir(cfg)
    holder["out"] = out
    fake = FakeGrid(node_ids(registered, seed), fake_client(kind, seed), wire=grid == "wire")
    return Server(kind, cfg, strategy, out, _Rounds(fake, strategy, cfg), fake)


class _Clock:
    """A round's phases: wall and CPU seconds each, the fake clients' share taken out."""

    def __init__(self, grid: FakeGrid) -> None:
        self.grid = grid
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, phase: str, fn, *args):
        t, c = time.perf_counter(), time.process_time()
        w0, c0 = self.grid.client_seconds, self.grid.client_cpu
        result = fn(*args)
        self.wall[phase] = time.perf_counter() - t - (self.grid.client_seconds - w0)
        self.cpu[phase] = time.process_time() - c - (self.grid.client_cpu - c0)
        return result


def drive_round(server: Server, server_round: int) -> _Clock:
    """One round as ``fedapps.runner._run_rounds`` runs it (round 0: the initial evaluation), each phase timed."""
    from flwr.app import ArrayRecord, ConfigRecord

    strategy, rounds, grid = server.strategy, server.rounds, server.grid
    clock = _Clock(grid)
    if server_round > 0:
        messages = clock("configure_train", lambda: (rounds.ensure_nodes(), strategy.configure_train(
            server_round, ArrayRecord(), ConfigRecord(), grid))[1])
        replies = clock("train_exchange", rounds.send, server_round, "train", messages)
        clock("aggregate_train", strategy.aggregate_train, server_round, replies)
    messages = clock("configure_evaluate", lambda: (rounds.ensure_nodes(), strategy.configure_evaluate(
        server_round, ArrayRecord(), ConfigRecord(), grid))[1])
    replies = clock("eval_exchange", rounds.send, server_round, "evaluate", messages)
    clock("aggregate_evaluate", strategy.aggregate_evaluate, server_round, replies)  # the record: metrics.jsonl
    clock("checkpoint", server.save_checkpoint, server_round)
    return clock


def _set_bytes(values) -> int:
    return sys.getsizeof(values) + sum(sys.getsizeof(v) for v in values)


def run_one(kind: str, registered: int, sampled: int, rounds: int, output_dir: Path, *, grid: str = "wire",
            seed: int = 0, progress=None) -> dict:
    """Rounds 0..``rounds`` of one server with ``registered`` nodes; per round its seconds, memory and
    what could grow with N. The run folder (metrics.jsonl, checkpoint.npz) stays in ``output_dir``."""
    from fedapps.runner import numpy_blas_single_thread

    task_identity()
    with numpy_blas_single_thread():
        gc.collect()
        setup_start = rss()[0]
        server = build_server(kind, registered, sampled, rounds, Path(output_dir), grid=grid, seed=seed)
        gc.collect()
        rss_setup, _ = rss()
        peak_reset = reset_peak()
        strategy, fake = server.strategy, server.grid
        initial = {k: v.copy() for k, v in strategy.global_state.items()}
        per_round = []
        for server_round in range(rounds + 1):
            before = dict(calls=fake.calls, ids=fake.ids_read, list_s=fake.list_seconds, client=fake.client_seconds,
                          client_cpu=fake.client_cpu, pushed=fake.pushed, first=fake.first_contact)
            t, c = time.perf_counter(), time.process_time()
            clock = drive_round(server, server_round)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            client, client_cpu = fake.client_seconds - before["client"], fake.client_cpu - before["client_cpu"]
            gc.collect()
            now, peak = rss()  # peak: the round's own when reset_peak works (VmHWM since the last reset)
            reset_peak()
            record = strategy.history[-1]
            checkpoint = server.out.path / "checkpoint.npz"
            row = {
                "round": server_round,
                "server_seconds": wall - client, "server_cpu": cpu - client_cpu,
                "client_seconds": client, "client_cpu": client_cpu,
                "phases": {k: round(v, 6) for k, v in clock.wall.items()},
                "phases_cpu": {k: round(v, 6) for k, v in clock.cpu.items()},
                "rss_mib": now, "hwm_mib": peak,
                "get_node_ids_calls": fake.calls - before["calls"], "node_ids_read": fake.ids_read - before["ids"],
                "node_list_seconds": fake.list_seconds - before["list_s"],
                "messages": fake.pushed - before["pushed"], "first_contact": fake.first_contact - before["first"],
                "trained": sum(1 for c in record["clients"] if "uplink_payload_bytes" in c),
                "accepted": record.get("accepted", 0), "evaluated": sum(1 for c in record["clients"]
                                                                        if "eval_num-examples" in c),
                "refused": len(record["refused"]), "missing": len(record["missing"]),
                "record_clients": len(record["clients"]), "record_bytes": len(json.dumps(record)),
                "checkpoint_bytes": checkpoint.stat().st_size,
                "configured_nodes": len(strategy.downlink.configured),
                "configured_nodes_bytes": _set_bytes(strategy.downlink.configured),
                "latent_sync_nodes": len(strategy.downlink.sync.synced) + len(strategy.downlink.sync.sending),
                "history_rounds": len(strategy.history),
            }
            per_round.append(row)
            if progress is not None:
                progress(row)
        moved = max(float(np.max(np.abs(strategy.global_state[k] - initial[k]))) for k in initial)
        return {"strategy": kind, "grid": grid, "registered": registered, "sampled": sampled, "rounds": rounds,
                "seed": seed, "rss_before_setup_mib": setup_start, "rss_setup_mib": rss_setup,
                "peak_is_per_round": peak_reset,
                "grid_node_list_bytes": len(fake.blob) if fake.wire else _set_bytes(fake.ids),
                "state_moved": moved, "run_dir": str(server.out.path), "per_round": per_round}


# ------------------------------------------------------------------------------ the SuperLink's side
SUPERLINKS = ("sqlite", "memory")


def superlink_get_nodes(registered: int, database: str = "sqlite", calls: int = 5) -> dict:
    """What one ``get_node_ids`` costs the SuperLink (another process; not in the ServerApp's seconds):
    ``registered`` online nodes in a fresh Flower 1.42 LinkState — ``sqlite`` (a ``state.db`` file, as
    ``postcard.loopback``'s persistent SuperLink and ``flower-superlink --database`` keep it) or
    ``memory`` (``flower-superlink``'s default) —, one run, then the Runtime API's ``GetNodes`` handler
    (``flwr.superlink.servicer.runtime.runtime_handlers.get_nodes``) and its response serialised,
    ``calls`` times."""
    import secrets

    from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
    from flwr.proto.runtime_pb2 import GetNodesRequest
    from flwr.proto.task_pb2 import Task
    from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.federation.noop_federation_manager import NOOP_FEDERATION_ID
    from flwr.superlink.servicer.runtime.runtime_handlers import get_nodes

    if database not in SUPERLINKS:
        raise ValueError(f"database must be one of {list(SUPERLINKS)}, got {database!r}")
    with tempfile.TemporaryDirectory(prefix="scale-superlink-") as tmp:
        path = str(Path(tmp) / "state.db") if database == "sqlite" else FLWR_IN_MEMORY_DB_NAME
        state = LinkStateFactory(path, NoOpFederationManager(), ObjectStoreFactory()).state()
        t = time.perf_counter()
        for _ in range(registered):
            node = state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(120), heartbeat_interval=1e6)
            state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=1e6)
        register = time.perf_counter() - t
        run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
        task = Task(run_id=run_id)
        seconds, size, count = [], 0, 0
        for _ in range(calls):
            t = time.perf_counter()
            res = get_nodes(GetNodesRequest(), state, task)
            size = len(res.SerializeToString())
            seconds.append(time.perf_counter() - t)
            count = len(res.nodes)
    return {"database": database, "registered": registered, "nodes_returned": count, "response_bytes": size,
            "seconds": seconds, "register_seconds": register}


# ------------------------------------------------------------------------------ the report
def _stats(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in rows]
    return float(np.median(values)), float(np.max(values))


def summarise(runs: list[dict]) -> dict:
    """One N's runs (its ``--repeat`` processes): medians and maxima over rounds 1..R of them all."""
    rows = [{**r, "rss_less_grid_mib": r["rss_mib"] - run["grid_node_list_bytes"] / 2**20}
            for run in runs for r in run["per_round"] if r["round"] > 0]
    out = {"processes": len(runs), "rounds": len(rows)}
    trained = [[r for r in run["per_round"] if r["round"] > 0] for run in runs]
    growth = [t[-1]["rss_mib"] - t[0]["rss_mib"] for t in trained]
    out["rss_growth_rounds_mib"] = {"median": float(np.median(growth)), "max": float(np.max(growth))}
    per_round = [(t[-1]["checkpoint_bytes"] - t[0]["checkpoint_bytes"]) / (len(t) - 1) for t in trained if len(t) > 1]
    out["checkpoint_growth_bytes"] = float(np.median(per_round)) if per_round else 0.0
    for key in ("server_seconds", "server_cpu", "client_seconds", "rss_mib", "rss_less_grid_mib", "hwm_mib",
                "get_node_ids_calls", "node_ids_read", "node_list_seconds", "messages", "first_contact", "trained",
                "record_bytes", "checkpoint_bytes", "configured_nodes", "configured_nodes_bytes"):
        out[key] = dict(zip(("median", "max"), _stats(rows, key)))
    for phase in PHASES:
        out[f"phase:{phase}"] = float(np.median([r["phases"][phase] for r in rows]))
    out["rss_setup_mib"] = float(np.median([run["rss_setup_mib"] for run in runs]))
    out["grid_node_list_bytes"] = runs[0]["grid_node_list_bytes"]
    out["round0_server_seconds"] = float(np.median([run["per_round"][0]["server_seconds"] for run in runs]))
    return out


ROWS = [  # (label, key, stat, format)
    ("server seconds / round (wall), median", "server_seconds", "median", "{:.4f}"),
    ("server seconds / round (wall), max", "server_seconds", "max", "{:.4f}"),
    ("server CPU seconds / round, median", "server_cpu", "median", "{:.4f}"),
    ("RSS after the round, MiB, median", "rss_mib", "median", "{:.1f}"),
    ("RSS after the round, MiB, max", "rss_mib", "max", "{:.1f}"),
    ("peak RSS during the round (VmHWM), MiB, max", "hwm_mib", "max", "{:.1f}"),
    ("RSS less the fake grid's own node list, MiB, median", "rss_less_grid_mib", "median", "{:.1f}"),
    ("RSS growth from round 1 to the last, MiB, median of processes", "rss_growth_rounds_mib", "median", "{:.2f}"),
    ("trained clients / round", "trained", "median", "{:.0f}"),
    ("messages pushed / round (train + eval)", "messages", "median", "{:.0f}"),
    ("first-contact messages (carry the YAML) / round, median", "first_contact", "median", "{:.0f}"),
    ("get_node_ids calls / round", "get_node_ids_calls", "median", "{:.0f}"),
    ("node ids read / round", "node_ids_read", "median", "{:,.0f}"),
    ("seconds reading the node list / round, median", "node_list_seconds", "median", "{:.4f}"),
    ("configured_nodes after the last round", "configured_nodes", "max", "{:,.0f}"),
    ("configured_nodes, bytes (set + ints), max", "configured_nodes_bytes", "max", "{:,.0f}"),
    ("round record (metrics.jsonl line), bytes, max", "record_bytes", "max", "{:,.0f}"),
    ("checkpoint.npz, bytes, max (last round)", "checkpoint_bytes", "max", "{:,.0f}"),
    ("fake clients' seconds / round (excluded), median", "client_seconds", "median", "{:.4f}"),
]


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}×" if a else "-"


def findings(results: dict, superlink: list[dict]) -> list[str]:
    """What grows with the registered count, where it sits, and how much per node (from code reading,
    with this run's numbers)."""
    if not results:
        return []
    label = next((k for k in results if ", wire grid" in k), next(iter(results)))
    by_n = results[label]
    ns = sorted(by_n, key=int)
    a, b = by_n[ns[0]], by_n[ns[-1]]
    na, nb = int(ns[0]), int(ns[-1])
    calls = b["get_node_ids_calls"]["median"]
    list_a, list_b = a["node_list_seconds"]["median"], b["node_list_seconds"]["median"]
    per_id = (list_b - list_a) / max(1, (nb - na) * calls)
    sql = {int(r["registered"]): float(np.median(r["seconds"])) for r in superlink if r["database"] == "sqlite"}
    mem = {int(r["registered"]): float(np.median(r["seconds"])) for r in superlink if r["database"] == "memory"}
    link = ""
    if nb in sql or nb in mem:
        parts = [f"{name} LinkState {d[na] * 1e3:.1f} → {d[nb] * 1e3:.0f} ms a call" for name, d in
                 (("SQLite", sql), ("in-memory", mem)) if na in d and nb in d]
        link = f" On the SuperLink each call costs more: {'; '.join(parts)} (section above)."
    cfg_bytes = b["configured_nodes_bytes"]["max"] / max(1, b["configured_nodes"]["max"])
    return [
        "## What grows with the registered count (code reading, with this run's numbers)", "",
        f"Numbers from \"{label}\", {na:,} → {nb:,} registered.", "",
        f"1. **The node list, {calls:.0f} times a round.** `grid.get_node_ids()` is called by "
        "`fedapps/runner.py` `_Rounds.ensure_nodes` (before training and before evaluation: 2), "
        "`strategies/base.py` `PayloadFedAvg.configure_train` (`self._available`: 1), Flower's "
        "`FedAvg.configure_train` / `configure_evaluate` (`flwr/serverapp/strategy/fedavg.py`, the sample size: 2) "
        "and Flower's `sample_nodes` (`strategy_utils.py`, the sample itself: 2). Each needs only the count or one "
        "sample, and each reads every registered node: with Flower's `HttpGrid` each is a `GetNodes` round trip "
        "carrying every node's `NodeInfo`. In the ServerApp (the wire grid's parse): "
        f"{list_a * 1e3:.1f} → {list_b * 1e3:.1f} ms a round, {per_id * 1e9:.0f} ns per node per call; it is most of "
        f"the growth of `configure_train` ({a['phase:configure_train'] * 1e3:.1f} → "
        f"{b['phase:configure_train'] * 1e3:.1f} ms) and `configure_evaluate` "
        f"({a['phase:configure_evaluate'] * 1e3:.1f} → {b['phase:configure_evaluate'] * 1e3:.1f} ms).{link} "
        "One list per round (or per phase) would serve all of them; not changed here (strategy and runner code).",
        f"2. **`configured_nodes`** (`strategies/downlink.py`, `Downlink.configured`): every node ever sent the "
        f"run's config, kept for the run: about {cfg_bytes:.0f} bytes a node (set slot + int), bounded by N "
        f"({b['configured_nodes']['max']:,.0f} nodes after {b['rounds'] // max(1, b['processes'])} rounds at "
        f"{nb:,}; at most ~{cfg_bytes * nb / 2**20:.1f} MiB at {nb:,}). Its effect on a round: with more nodes "
        f"registered, more of the sampled ones are new and get the YAML ({a['first_contact']['median']:.0f} → "
        f"{b['first_contact']['median']:.0f} first-contact messages a round of "
        f"{b['messages']['median']:.0f}) — bounded by the sampled count, not N.",
        "3. **`latent_sync`** (`strategies/channel.py` `LatentSync`, a latent downlink only; not exercised by this "
        "FLITE's fp32 downlink): two dicts node → round (`sending`, `synced`) for every node sent a message / that "
        "answered, for the run: bounded by N, about 2 × 100 bytes a node contacted.",
        f"4. **Nothing else is per registered node.** The round record (the ledger's `clients`) holds the nodes "
        f"sent a message that round ({a['record_bytes']['max']:,.0f} vs {b['record_bytes']['max']:,.0f} bytes); "
        "`banned` holds proven cheats; Flower's `random.sample` copies the list only below ~1,045 nodes for 100 "
        "sampled. The fake grid's own node list (the SuperLink's, in a deployment) is in this process's RSS: "
        f"{a['grid_node_list_bytes']:,} → {b['grid_node_list_bytes']:,} bytes (the row \"RSS less the fake grid's "
        "own node list\").",
        f"5. **Not per node, but growing every round:** the checkpoint holds the whole history (every round's "
        f"record: the sampled nodes' entries), rewritten and fsync'd each round: +"
        f"{b['checkpoint_growth_bytes'] / 1e3:.0f} kB a round here ({b['checkpoint_bytes']['max'] / 1e3:.0f} kB "
        f"after {b['rounds'] // max(1, b['processes'])} rounds; ~{b['checkpoint_growth_bytes'] * 1000 / 1e6:.0f} MB "
        "after 1,000 rounds), and `strategy.history` in memory the same.", ""]


def report(results: dict, args_line: str, meta: dict, superlink: list[dict] | None = None) -> str:
    """Markdown: per (strategy, grid), a table of each N side by side with the ratio of each N to the first."""
    head = ["# The server at scale: registered vs sampled nodes (issue #63, item 2)", "",
             f"Command: `{args_line}`", "",
             f"Machine: {meta['machine']}; Python {meta['python']}, Flower {meta['flwr']}, numpy {meta['numpy']}; "
             f"{meta['date']}.", "",
             "No training: the server's strategy, Flower's sampling, aggregation, the round record (metrics.jsonl) "
             "and the checkpoint, driven by `fedapps.runner`'s own `_Rounds` with fake client replies "
             "(bench/scale_server.py's docstring says how). Each N ran in a fresh process. Server seconds are the "
             "round's time less the fake clients' (reported apart); RSS is read after each round (after "
             "`gc.collect()`). Median and max over rounds 1..R of every process. Wall seconds move with whatever "
             "else the machine runs (the processes of each N are interleaved for that); CPU seconds (the process's "
             "own, less the fake clients') much less.", ""]
    lines: list[str] = []
    verdicts = []
    for label, by_n in results.items():
        ns = sorted(by_n, key=int)
        first = by_n[ns[0]]
        lines += [f"## {label}", "", "| per round | " + " | ".join(f"{int(n):,} registered" for n in ns) + " | "
                  + " | ".join(f"ratio {int(n):,} ÷ {int(ns[0]):,}" for n in ns[1:]) + " |",
                  "|---|" + "---:|" * (2 * len(ns) - 1)]
        for text, key, stat, fmt in ROWS:
            values = [by_n[n][key][stat] for n in ns]
            lines.append(f"| {text} | " + " | ".join(fmt.format(v) for v in values) + " | "
                         + " | ".join(_ratio(values[0], v) for v in values[1:]) + " |")
        lines += ["", "Server seconds by phase (median over rounds, wall, fake clients' share taken out):", "",
                  "| phase | " + " | ".join(f"{int(n):,}" for n in ns) + " |", "|---|" + "---:|" * len(ns)]
        for phase in PHASES:
            lines.append(f"| {phase} | " + " | ".join(f"{by_n[n][f'phase:{phase}']:.4f}" for n in ns) + " |")
        lines.append("")
        last = by_n[ns[-1]]
        dn = int(ns[-1]) - int(ns[0])
        if dn > 0:
            slope_s = (last["server_seconds"]["median"] - first["server_seconds"]["median"]) / dn
            slope_list = (last["node_list_seconds"]["median"] - first["node_list_seconds"]["median"]) / dn
            slope_rss = (last["rss_mib"]["median"] - first["rss_mib"]["median"]) * 2**20 / dn
            lines += [f"Per registered node ({int(ns[0]):,} → {int(ns[-1]):,}): {slope_s * 1e6:+.2f} µs of server "
                      f"time per round ({slope_list * 1e6:+.2f} µs of it reading the node list, "
                      f"{last['get_node_ids_calls']['median']:.0f} calls a round), {slope_rss:+.0f} bytes of RSS. "
                      f"The grid's node list itself: {first['grid_node_list_bytes']:,} → "
                      f"{last['grid_node_list_bytes']:,} bytes. RSS after setup (imports, config, strategy, "
                      f"grid; before round 0): {first['rss_setup_mib']:.1f} → {last['rss_setup_mib']:.1f} MiB; "
                      f"round 0 (the initial evaluation) {first['round0_server_seconds']:.4f} → "
                      f"{last['round0_server_seconds']:.4f} s.", ""]
            seconds = last["server_seconds"]["median"] / first["server_seconds"]["median"]
            cpu = last["server_cpu"]["median"] / first["server_cpu"]["median"]
            memory = last["rss_mib"]["median"] / first["rss_mib"]["median"]
            ok = seconds <= TARGET and memory <= TARGET
            verdicts.append(f"- {label}: seconds {seconds:.2f}× (CPU seconds {cpu:.2f}×), RSS {memory:.2f}× "
                            f"({'within' if ok else 'NOT within'} {TARGET}×; node list "
                            f"{first['node_list_seconds']['median'] * 1e3:.1f} → "
                            f"{last['node_list_seconds']['median'] * 1e3:.1f} ms a round)")
    if superlink:
        calls = int(np.median([by_n[n]["get_node_ids_calls"]["median"] for by_n in results.values() for n in by_n]))
        ns = sorted({int(r["registered"]) for r in superlink}, key=int)
        lines += ["## The SuperLink's side of the node list (another process: not in the seconds above)", "",
                  "Flower 1.42's `HttpGrid.get_node_ids` is a `GetNodes` call: the SuperLink reads every registered "
                  "node from its LinkState and sends each one's `NodeInfo`. Measured on a fresh LinkState with N "
                  "online nodes (bench/scale_server.py `superlink_get_nodes`: the Runtime API's handler and its "
                  f"response serialised); a round makes {calls} such calls (measured above), each waited for by the "
                  "ServerApp.", "",
                  "| LinkState | " + " | ".join(f"{n:,} registered" for n in ns) + " | "
                  + " | ".join(f"ratio {n:,} ÷ {ns[0]:,}" for n in ns[1:]) + " |",
                  "|---|" + "---:|" * (2 * len(ns) - 1)]
        for database in SUPERLINKS:
            rows = {int(r["registered"]): r for r in superlink if r["database"] == database}
            if not rows:
                continue
            per_call = [float(np.median(rows[n]["seconds"])) if n in rows else float("nan") for n in ns]
            lines.append(f"| {database}: seconds per `GetNodes`, median | " + " | ".join(f"{v:.4f}" for v in per_call)
                         + " | " + " | ".join(_ratio(per_call[0], v) for v in per_call[1:]) + " |")
            per_round = [calls * v for v in per_call]
            lines.append(f"| {database}: × {calls} calls = seconds per round | "
                         + " | ".join(f"{v:.3f}" for v in per_round) + " | "
                         + " | ".join(_ratio(per_round[0], v) for v in per_round[1:]) + " |")
            sizes = [rows[n]["response_bytes"] if n in rows else 0 for n in ns]
            lines.append(f"| {database}: response bytes per call | " + " | ".join(f"{v:,}" for v in sizes) + " | "
                         + " | ".join(_ratio(sizes[0], v) for v in sizes[1:]) + " |")
        lines.append("")
        for database in SUPERLINKS:
            rows = {int(r["registered"]): r for r in superlink if r["database"] == database}
            if len(rows) > 1:
                a, b = rows[ns[0]], rows[ns[-1]]
                verdicts.append(f"- SuperLink `GetNodes` ({database} LinkState), {calls} calls a round: "
                                f"{calls * np.median(a['seconds']):.3f} → {calls * np.median(b['seconds']):.3f} s "
                                f"per round ({_ratio(np.median(a['seconds']), np.median(b['seconds']))})")
    lines += findings(results, superlink or [])
    head += ["## Headline: the last N against the first (median per round; target ≤ "
             f"{TARGET}× for seconds and RSS)", "", *verdicts, ""]
    return "\n".join(head + lines) + "\n"


# ------------------------------------------------------------------------------ processes
def child(args) -> int:
    """``--one N``: one server in this process; its result to ``--json``."""
    import logging

    logging.getLogger("flwr").setLevel(WARNING)  # the per-round INFO lines (sampling, records) off the console
    keep = args.runs is not None
    folder = Path(args.runs) if keep else Path(tempfile.mkdtemp(prefix="scale-server-"))
    folder.mkdir(parents=True, exist_ok=True)
    label = f"{args.strategies[0]}/{args.grids[0]} N={args.one:,}"

    def progress(row):
        print(f"  {label} round {row['round']}: server {row['server_seconds']:.3f} s (cpu {row['server_cpu']:.3f}), "
              f"clients {row['client_seconds']:.3f} s, RSS {row['rss_mib']:.1f} MiB, trained {row['trained']}, "
              f"evaluated {row['evaluated']}, node ids read {row['node_ids_read']:,} in {row['get_node_ids_calls']} "
              f"calls ({row['node_list_seconds']:.4f} s), configured {row['configured_nodes']:,}", file=sys.stderr,
              flush=True)

    try:
        result = run_one(args.strategies[0], args.one, args.sampled, args.rounds, folder, grid=args.grids[0],
                         seed=args.seed, progress=progress)
    finally:
        if not keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    Path(args.json).write_text(json.dumps(result))
    return 0


def benchmark(*, registered, sampled: int, rounds: int, out: Path, strategies=("flite",), grids=("wire",),
              repeat: int = 1, in_process: bool = False, runs: Path | None = None, seed: int = 0,
              superlinks=(), command: str = "") -> dict:
    """Every (strategy, grid, N): ``repeat`` processes each (or in this process), then the report in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw: dict = {}
    with tempfile.TemporaryDirectory(prefix="scale-server-") as tmp:
        for kind in strategies:
            for grid in grids:
                label = f"{kind}, {grid} grid, {sampled} sampled"
                for rep in range(repeat):
                    for n in registered:  # interleaved: a slower spell of a shared machine hits every N alike
                        print(f"[{label}] N={n:,} (process {rep + 1}/{repeat})", file=sys.stderr, flush=True)
                        if in_process:
                            folder = (runs or Path(tmp)) / f"{kind}-{grid}-{n}-{rep}"
                            result = run_one(kind, n, sampled, rounds, folder, grid=grid, seed=seed + rep)
                        else:
                            path = Path(tmp) / f"{kind}-{grid}-{n}-{rep}.json"
                            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(n), "--sampled",
                                   str(sampled), "--rounds", str(rounds), "--strategies", kind, "--grids", grid,
                                   "--seed", str(seed + rep), "--json", str(path)]
                            if runs is not None:
                                cmd += ["--runs", str(Path(runs) / f"{kind}-{grid}-{n}-{rep}")]
                            subprocess.run(cmd, check=True, cwd=ROOT)
                            result = json.loads(path.read_text())
                        raw.setdefault(label, {}).setdefault(str(n), []).append(result)
        superlink_rows = []
        for database in superlinks:
            for n in registered:
                print(f"[SuperLink GetNodes, {database}] N={n:,}", file=sys.stderr, flush=True)
                if in_process:
                    row = superlink_get_nodes(n, database)
                else:
                    path = Path(tmp) / f"superlink-{database}-{n}.json"
                    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--superlink-one", str(n),
                                    "--superlink", database, "--json", str(path)], check=True, cwd=ROOT)
                    row = json.loads(path.read_text())
                print(f"  {database} N={n:,}: GetNodes {np.median(row['seconds']):.4f} s a call (median of "
                      f"{len(row['seconds'])}), {row['response_bytes']:,} bytes", file=sys.stderr, flush=True)
                superlink_rows.append(row)
    results = {label: {n: summarise(rs) for n, rs in by_n.items()} for label, by_n in raw.items()}
    import flwr

    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
                       f"({len(os.sched_getaffinity(0))} usable)",
            "python": platform.python_version(), "flwr": getattr(flwr, "__version__", "?"),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "scale-server.md").write_text(report(results, command, meta, superlink_rows))
    (out / "scale-server.json").write_text(json.dumps({"command": command, "meta": meta, "sampled": sampled,
                                                       "rounds": rounds, "registered": list(registered),
                                                       "target": TARGET, "summary": results,
                                                       "superlink": superlink_rows, "runs": raw},
                                                      indent=1) + "\n")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registered", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--sampled", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=None,
                        help="default: both (--quick: flite)")
    parser.add_argument("--grids", nargs="+", choices=GRIDS, default=None, help="default: both (--quick: wire)")
    parser.add_argument("--repeat", type=int, default=None, help="processes per N, interleaved (default 3; --quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 rounds, N = 100 and 1,000, flite on the wire grid")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "scale-server")
    parser.add_argument("--runs", type=Path, default=None, help="keep the run folders here (default: a temp folder)")
    parser.add_argument("--superlink", nargs="*", choices=SUPERLINKS, default=None,
                        help="also time the SuperLink's GetNodes on these LinkStates (default: both; --quick: none; "
                             "give the flag alone for none)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one N
    parser.add_argument("--superlink-one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        return child(args)
    if args.superlink_one is not None:
        args.json.write_text(json.dumps(superlink_get_nodes(args.superlink_one, args.superlink[0])))
        return 0
    if args.quick:
        args.rounds, args.registered = 2, [100, 1000]
    args.strategies = args.strategies or (["flite"] if args.quick else list(STRATEGIES))
    args.grids = args.grids or (["wire"] if args.quick else list(GRIDS))
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.superlink = ([] if args.quick else list(SUPERLINKS)) if args.superlink is None else args.superlink
    command = "python bench/scale_server.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    results = benchmark(registered=args.registered, sampled=args.sampled, rounds=args.rounds, out=args.out,
                        strategies=args.strategies, grids=args.grids, repeat=args.repeat, runs=args.runs,
                        seed=args.seed, superlinks=args.superlink, command=command.strip())
    print((args.out / "scale-server.md").read_text())
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
