"""Issue #63 (item 1): what makes a simulation of 1,000 clients cost its clients' work, not its registered
nodes: Flower's message extractor asked only of nodes with a message waiting, the run config parsed once
per worker, every client's partition drawn at once (bench/thousand.py measures the whole)."""

import threading
from queue import Queue
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.server.superlink.fleet.vce import vce_api
from omegaconf.errors import ReadonlyConfigError

from clients import partition
from fedapps.config import compose, to_yaml
from fedapps.session import parsed
from fedapps.simulation import engine_patched, pending_first


class FakeState:
    """Flower's in-memory link state as the extractor sees it: a store of messages, a lock, and
    get_message_ins (which marks what it returns delivered)."""

    def __init__(self, waiting_for):
        self.lock = threading.RLock()
        self.asked = []
        self.message_ins_store = {
            f"m{node}": SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node, delivered_at=""), node=node)
            for node in waiting_for}

    def get_message_ins(self, node_id, limit):
        self.asked.append(node_id)
        out = [m for m in self.message_ins_store.values()
               if m.metadata.dst_node_id == node_id and m.metadata.delivered_at == ""][:limit]
        for m in out:
            m.metadata.delivered_at = "now"
        return out


class OnePass:
    """An f_stop that lets the loop run exactly once."""

    def __init__(self):
        self.passes = 0

    def is_set(self):
        self.passes += 1
        return self.passes > 1

    def wait(self, seconds):
        return False


def one_pass(extract, waiting_for, nodes):
    state, queue = FakeState(waiting_for), Queue()
    extract(state, queue, {node: node for node in nodes}, OnePass())
    return state, sorted(queue.get().node for _ in range(queue.qsize()))


def test_the_extractor_hands_out_what_flowers_does_asking_only_the_nodes_with_a_message():
    nodes, waiting = range(1, 1001), [7, 300, 999]
    ours, queued = one_pass(pending_first, waiting, nodes)
    flowers, flowers_queued = one_pass(vce_api.add_messages_to_queue, waiting, nodes)
    assert queued == flowers_queued == waiting
    assert sorted(ours.asked) == waiting and len(flowers.asked) == 1000  # 3 asks a pass, not 1,000


def test_the_patch_lasts_one_run():
    original = vce_api.add_messages_to_queue
    with engine_patched():
        assert vce_api.add_messages_to_queue is pending_first
    assert vce_api.add_messages_to_queue is original


def test_a_workers_run_config_is_parsed_once_and_read_only():
    text = to_yaml(compose([], preset="test"))
    cfg = parsed(text)
    assert parsed(str(text)) is cfg and cfg.algorithm.name == "fedavg-lora"
    with pytest.raises(ReadonlyConfigError):
        cfg.train.lr = 1.0  # shared by every message of the run on this worker


def test_every_clients_partition_is_drawn_once(monkeypatch):
    monkeypatch.setenv("POSTCARD_PARTITION_CACHE", "off")
    calls = []
    real = partition._compute
    monkeypatch.setattr(partition, "_compute", lambda *a: calls.append(a) or real(*a))
    labels = np.repeat(np.arange(10), 300)
    kw = {"method": "dirichlet", "num_partitions": 100, "seed": 11, "alpha": 0.5, "min_partition_size": 5}
    parts = [partition.partition_indices(labels, partition_id=j, **kw) for j in range(100)]
    assert len(calls) == 1
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)  # every item, once
    partition._PACKED.clear()
