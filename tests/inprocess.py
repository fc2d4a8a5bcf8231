"""A method's ClientApp and strategy driven in this process, round by round (no Flower runtime):
the real client code (``fedapps.client_app``) answers the strategy's real messages.

:func:`run` is a whole run so: ``fedapps.runner.run_server`` (the ServerApp's body: rounds, checkpoints,
resume, the run folder) on a grid whose nodes are Postcard's ClientApp in this process. It gives the
same metrics as ``fedapps.simulation.simulate`` (Ray) and ``flwr run``, to the bit (asserted in
test_flwr_run), without Ray's start (#40: the per-method "learns" runs use it; tens of seconds each).
"""

from __future__ import annotations

import copy
import json
import uuid

from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedapps import client_app
from fedapps.config import to_yaml
from strategies import packing
from strategies.screening import CONFIG_RECORD


def answer(msg: Message, ctx: Context) -> Message:
    """Postcard's ClientApp's reply to ``msg``, its arrays unpacked (what the server's
    ``collect_replies`` hands the strategy; on the wire they travel packed, strategies.packing)."""
    out = client_app.app(msg, ctx)
    if out.has_content():
        out.content = packing.unpack(out.content)
    return out


def context(node: int, clients: int = 2) -> Context:
    """Node ``node`` (1-based) holding partition ``node - 1`` of ``clients``."""
    return Context(run_id=1, node_id=node, node_config={"partition-id": node - 1, "num-partitions": clients},
                   state=RecordDict(), run_config={})


class InProcessGrid:
    """Flower's Grid as ``run_server`` uses it (node ids, push, pull): every message is answered at once
    by ``clients`` (Postcard's ClientApp) with node ``n``'s own Context (partition ``n - 1``). One process
    serves every node in turn, as one Ray actor serves several simulated nodes (fedapps.session)."""

    def __init__(self, num_clients: int, clients=None) -> None:
        self.clients = clients or client_app.app
        self.contexts = {node: context(node, num_clients) for node in range(1, num_clients + 1)}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid  # as the SuperLink assigns it
            self.replies[mid] = self.clients(msg, self.contexts[msg.metadata.dst_node_id])
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(mid) for mid in list(ids) if mid in self.replies]


def run(cfg, clients=None) -> dict:
    """``cfg`` run to its end in this process (``fedapps.simulation.simulate``'s run, without Ray): its summary.
    Like a fresh Ray actor, the run starts with no prepared model cached (fedapps.session); what the clients
    change in this process, the torch thread count (train.threads) and the global random generators they
    seed, is given back afterwards, so that later tests in the process see none of it."""
    import random

    import numpy as np
    import torch

    from fedapps import session
    from fedapps.resolved import client_count
    from fedapps.runner import run_server

    threads, rng = torch.get_num_threads(), (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    session._MODELS.clear()
    session._TASKS.clear()
    try:
        return run_server(InProcessGrid(client_count(cfg), clients), cfg)
    finally:
        session._MODELS.clear()
        session._TASKS.clear()
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])


def message(cfg, arrays, phase: str, server_round: int, node: int, config: dict | None = None) -> Message:
    return Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round, **(config or {})}),
                               CONFIG_RECORD: ConfigRecord({"yaml": to_yaml(cfg)})}), dst_node_id=node,
                   message_type=phase)


def train_round(cfg, strategy, server_round: int, nodes: dict) -> list[Message]:
    """Every node's training reply to the strategy's own per-node train config of this round."""
    replies = []
    for node, ctx in nodes.items():
        config = strategy.train_config_for(server_round, node, ConfigRecord({}))
        replies.append(answer(message(cfg, strategy.downlink_arrays(), "train", server_round, node,
                                              dict(config)), ctx))
    return replies


def evaluate_round(cfg, strategy, server_round: int, nodes: dict) -> dict:
    """The strategy's aggregate of every node's evaluation of its current downlink."""
    replies = [answer(message(cfg, strategy.downlink_arrays(), "evaluate", server_round, node), ctx)
               for node, ctx in nodes.items()]
    return strategy.aggregate_evaluate(server_round, replies)


def pool_overrides(algorithm: str, folder) -> list[str]:
    """What ``algorithm`` needs to run on the test preset's model: SmartFed a pool (:func:`fake_pool`)."""
    if algorithm != "smartfed":
        return []
    from clients.models.llm import load_causal_lm
    from fedapps.config import compose

    base = compose(preset="test")
    return [f"algorithm.pool={fake_pool(folder, load_causal_lm(base.model, seed=int(base.seed))[0])}"]


def fake_pool(folder, model, overrides=()) -> str:
    """A SmartFed pool holding one LoRA adapter on q/v of the tiny Llama, or of the model ``overrides`` name
    (``model``: that backbone), as a LoRA run leaves it."""
    from clients.adapters import apply_lora
    from fedapps.config import compose
    from postcard import pool as pool_cli

    cfg = compose(["algorithm.lora.target_modules=[q_proj,v_proj]", *overrides], preset="test")
    run = folder / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "summary.json").write_text(json.dumps({"metric": "perplexity", "initial_metric": 9.0, "final_metric": 8.0}))
    apply_lora(copy.deepcopy(model), cfg.algorithm.lora, seed=0).save_pretrained(str(run / "adapter"))
    pool = folder / "pool"
    assert pool_cli.main(["add", str(run), "--pool", str(pool)]) == 0
    return str(pool)
