"""The server side of a run, common to every algorithm.

``run_server(grid, cfg)``: make the run folder, let the algorithm build its strategy and
initial state, wait for the SuperNodes, evaluate the initial model (round 0), run the
rounds, save the final global state, write the summary and plots.

The round loop is explicit (rather than Flower's ``Strategy.start``) for two reasons:

* **fault tolerance** — replies are collected by :func:`collect_replies`: a round waits at
  most ``strategy.timeout`` seconds, and once ``strategy.min_clients`` nodes have answered
  it waits at most ``strategy.straggler_timeout`` more for the rest. A node that never
  answers (killed, unreachable; Flower also reports a node whose heartbeat stopped as
  unavailable) is logged with its id and recorded in the round's ``missing`` list; the
  round completes with the others.
* **checkpoints** — after every round (round 0 included) the strategy's state, the round
  and the history go to ``checkpoint.npz`` in the run folder (``fedapps.checkpoint``); a
  run started again with ``resume`` continues after the last completed round.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from omegaconf import OmegaConf
from threadpoolctl import ThreadpoolController

from fedapps import checkpoint as ckpt
from fedapps import registry
from fedapps.config import to_yaml
from fedapps.resolved import client_count
from strategies import packing

# errors Flower itself puts in place of a reply that will never come
_UNAVAILABLE = {ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE}


class ServerSetupError(RuntimeError):
    pass


class NoReplies(RuntimeError):
    """No node answered a round's messages: the run stops (and can be resumed)."""


def wait_for_nodes(grid: Grid, wanted: int | None, seconds: float, settle: float | None = None) -> int:
    """Wait until ``wanted`` nodes (or, if None, at least one and a stable count) connect.

    With ``settle``, a count that has not changed for ``settle`` seconds while still below
    ``wanted`` fails at once (a simulation registers all its SuperNodes at the start, so waiting
    longer cannot help) rather than after ``seconds``.
    """
    deadline = time.time() + float(seconds)
    last, stable_since = -1, time.time()
    hint = "in simulation pass --federation-config \"num-supernodes=N\"; in deployment start more SuperNodes"
    while True:
        count = len(list(grid.get_node_ids()))
        if count != last:
            last, stable_since = count, time.time()
        if wanted is not None and count >= wanted:
            return count
        if wanted is None and count > 0 and time.time() - stable_since >= 2.0:
            return count
        if wanted is not None and count > 0 and settle is not None and time.time() - stable_since >= settle:
            raise ServerSetupError(f"{count} SuperNode(s) connected and no more for {settle:.0f} s, but the run has "
                                   f"num_clients={wanted}: {hint}, or set num_clients={count} "
                                   "(overrides='num_clients=N')")
        if time.time() > deadline:
            if wanted is None and count > 0:
                return count
            raise ServerSetupError(f"{count} SuperNode(s) connected after {seconds:.0f} s, {wanted or 1} needed ({hint})")
        time.sleep(0.5)


def collect_replies(
    grid: Grid,
    messages: list[Message],
    *,
    timeout: float,
    quorum: int | None = None,
    straggler_timeout: float | None = None,
    poll: float = 0.2,
) -> tuple[list[Message], dict[int, str]]:
    """Send ``messages`` and gather their replies; returns (replies, {missing node id: reason}).

    Stops when every node answered, after ``timeout`` seconds, or ``straggler_timeout``
    seconds after ``quorum`` nodes answered successfully. Flower's own "node / message
    unavailable" errors (a node whose heartbeat stopped) count as missing, not as replies,
    so that the missing node is named (such errors come from the SuperLink, not the node).
    Extra replies (a second one to the same message) are returned too: the strategy refuses
    them with a reason.
    """
    if not messages:
        return [], {}
    outgoing = [_packed(m) for m in messages]  # a message's many arrays travel as one (strategies.packing)
    ids = set(grid.push_messages(outgoing)) - {None, ""}
    for message, sent in zip(messages, outgoing):
        if sent is not message and sent.metadata.message_id:  # the strategy matches replies against its own messages
            message.metadata.__dict__["_message_id"] = sent.metadata.message_id  # as the grid sets it
    node_of = {str(m.metadata.message_id): int(m.metadata.dst_node_id) for m in outgoing}
    missing: dict[int, str] = {
        node: "the message could not be pushed to the SuperLink" for mid, node in node_of.items() if mid not in ids
    }
    pending = {mid for mid in ids if mid in node_of}
    replies: list[Message] = []
    start = time.time()
    quorum_at = None
    ok = 0
    while pending:
        for reply in grid.pull_messages(set(pending)):
            mid = str(reply.metadata.reply_to_message_id)
            if mid not in pending:
                # a second reply to a message, or one to no message of this phase: the strategy
                # refuses and records it (never silently dropped, never counted twice)
                _unpack(reply, int(reply.metadata.src_node_id))
                replies.append(reply)
                continue
            pending.discard(mid)
            if reply.has_error() and reply.error.code in _UNAVAILABLE:
                missing[node_of[mid]] = f"unavailable ({reply.error.reason.strip()})"
                continue
            _unpack(reply, node_of[mid])
            replies.append(reply)
            ok += 0 if reply.has_error() else 1
        if not pending:
            break
        now = time.time()
        if quorum is not None and ok >= quorum and quorum_at is None:
            quorum_at = now
        if quorum_at is not None and straggler_timeout is not None and now - quorum_at >= straggler_timeout:
            for mid in pending:
                missing[node_of[mid]] = (f"no reply {straggler_timeout:.0f} s after {ok} of {len(node_of)} nodes "
                                         f"had answered (strategy.straggler_timeout)")
            break
        if now - start >= timeout:
            for mid in pending:
                missing[node_of[mid]] = f"no reply within {timeout:.0f} s (strategy.timeout)"
            break
        time.sleep(poll)
    return replies, missing


def _packed(message: Message) -> Message:
    """``message`` with its arrays packed into one (a new message with the same destination,
    type, group and time to live), or ``message`` itself when there is nothing to pack."""
    if not message.has_content():
        return message
    content = packing.pack(message.content)
    if content is message.content:
        return message
    meta = message.metadata
    return Message(content=content, dst_node_id=meta.dst_node_id, message_type=meta.message_type,
                   group_id=meta.group_id, ttl=meta.ttl)


def _unpack(reply: Message, node: int) -> None:
    """A reply's packed arrays unpacked in place (strategies.packing.receive); one that cannot be
    read is logged with the reason (its strategy refuses the reply)."""
    reason = packing.receive(reply)
    if reason:
        log(WARNING, "node %s: its reply's packed arrays cannot be read: %s", node, reason)


class _Rounds:
    """Sends one phase of a round, records the nodes that did not answer."""

    def __init__(self, grid: Grid, strategy, cfg) -> None:
        self.grid = grid
        self.strategy = strategy
        self.timeout = float(cfg.strategy.timeout)
        straggler = cfg.strategy.get("straggler_timeout")
        self.straggler_timeout = float(straggler) if straggler is not None else None
        self.min_clients = int(cfg.strategy.min_clients) if cfg.strategy.min_clients else None
        self.node_wait = float(cfg.strategy.node_wait)

    def send(self, server_round: int, phase: str, messages) -> list[Message]:
        messages = list(messages)
        quorum = min(self.min_clients, len(messages)) if self.min_clients else None
        # an in-memory grid (a simulation) is as cheap to poll as it says (Flower's pull_interval); a SuperLink's
        # pull is a network call: every 0.2 s
        poll = min(0.2, float(getattr(self.grid, "pull_interval", 0.2)))
        replies, missing = collect_replies(self.grid, messages, timeout=self.timeout, quorum=quorum,
                                           straggler_timeout=self.straggler_timeout, poll=poll)
        for node_id, reason in sorted(missing.items()):
            self.strategy.record_missing(server_round, node_id, phase, reason)
        if messages and not replies:
            raise NoReplies(f"round {server_round}: none of the {len(messages)} SuperNodes answered the {phase} "
                            "messages; the run stops here. Restart the SuperNodes and start the run again with "
                            "resume (see docs/deploy.md) to continue from the last checkpoint.")
        if missing:
            log(WARNING, "round %s: %s goes on with %d of %d replies", server_round, phase, len(replies), len(messages))
        return replies

    def ensure_nodes(self) -> None:
        """Flower's node sampling waits forever below its minimum: wait ``node_wait`` s, then fail."""
        needed = int(getattr(self.strategy, "min_available_nodes", 1) or 1)
        if len(list(self.grid.get_node_ids())) < needed:
            log(WARNING, "fewer than %d SuperNodes connected; waiting up to %.0f s", needed, self.node_wait)
            wait_for_nodes(self.grid, needed, self.node_wait)


def numpy_blas_single_thread():
    """A context in which numpy's (and scipy's) OpenBLAS computes on the calling thread only.

    The server's numpy work is aggregation: sums over a few clients' arrays, where a BLAS
    thread pool gains nothing. Its pool has hung a simulated server for good: a ServerApp
    thread spun in OpenBLAS's ``exec_blas`` (a SmartFed pool warm start's ``B @ A``) with no
    worker thread left in the process (numpy 2.4.6, OpenBLAS 0.3.31; probably one of the
    thread-pool deadlocks fixed in OpenBLAS releases up to 0.3.34, not proven). With one
    thread there is no pool to wait on. torch's own BLAS and OpenMP are left alone (θ_pre's pretraining runs here).
    scipy's OpenBLAS, another library, is loaded first so that the limit reaches it too
    (the limit holds for the libraries loaded when it is set; a run's imports may load scipy's later)."""
    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS)

    return ThreadpoolController().select(internal_api="openblas").limit(limits=1)


def run_server(grid: Grid, cfg) -> dict:
    """The whole server side of a run (module docstring), numpy's BLAS on one thread."""
    with numpy_blas_single_thread():
        return _run_server(grid, cfg)


class NodeListCache:
    """Flower's Grid with its node list read at most once per ``ttl`` seconds. A round asked for the whole list
    seven times (the runner's node check twice, the strategy's count, Flower's configure_* and sample_nodes
    twice), each a read of every registered node on the SuperLink: 3.4 s a round with 10,000 nodes on its
    SQLite store (bench/scale_server.py). Within a phase the reads come milliseconds apart; a caller that
    waits for nodes to join (Flower's sample_nodes sleeps 1 s between looks) sees a fresh list after ``ttl``.
    Everything else is the grid's own."""

    def __init__(self, grid: Grid, ttl: float = 0.5) -> None:
        self._grid, self._ttl = grid, float(ttl)
        self._nodes: list[int] | None = None
        self._at = 0.0

    def get_node_ids(self):
        now = time.monotonic()
        if self._nodes is None or now - self._at > self._ttl:
            self._nodes, self._at = list(self._grid.get_node_ids()), now
        return list(self._nodes)

    def __getattr__(self, name):
        return getattr(self._grid, name)


def _run_server(grid: Grid, cfg) -> dict:
    grid = NodeListCache(grid)  # one read of the node list per phase, not seven a round (see the class)
    method = registry.get(cfg.algorithm.name)
    resume_dir, must_exist = ckpt.resume_folder(cfg)  # a bad resume request fails before any waiting
    if cfg.get("base") is not None and cfg.base.name == "public":  # θ_pre: trained here once (clients on this machine load it), else reused
        from clients.pretrain import ensure_base

        log(INFO, "base=public: θ_pre at %s", ensure_base(cfg))
    wanted = client_count(cfg)
    settle = cfg.strategy.get("node_settle")
    count = wait_for_nodes(grid, wanted, float(cfg.strategy.node_wait), None if settle is None else float(settle))
    if count > wanted:  # Flower would sample them all: each would train a partition of another split
        raise ServerSetupError(f"{count} SuperNodes are connected but the run has num_clients={wanted}: start "
                               f"{wanted} (--federation-config \"num-supernodes={wanted}\" in simulation) or set "
                               f"num_clients={count} (overrides='num_clients={count}')")
    OmegaConf.set_struct(cfg, False)
    cfg.num_clients = wanted  # resolved before the config is written and sent
    OmegaConf.set_struct(cfg, True)

    # the method's server first: a run that cannot start (no SmartFed pool, a bad budget) leaves no folder
    plan = method.plan_server(cfg, on_round_end=lambda record: out.write_round(record), config_yaml=to_yaml(cfg))
    strategy = plan.strategy
    out, checkpoint = ckpt.open_run_dir(cfg, resume_dir, must_exist)
    log(INFO, "Postcard: %s on %s with %s, %d clients, %d rounds -> %s",
        cfg.algorithm.name, cfg.task.name, cfg.model.name, cfg.num_clients, cfg.rounds, out.path)
    try:
        return _run_rounds(grid, cfg, plan, out, checkpoint)
    except BaseException as err:  # the folder says the run failed, and why; the error goes on up
        out.fail(err, strategy.history)
        raise


def _run_rounds(grid: Grid, cfg, plan, out, checkpoint) -> dict:
    strategy = plan.strategy
    log(INFO, "federated tensors: %d (%s values); uplink format %s",
        len(strategy.uplink_keys), f"{sum(strategy.global_state[k].size for k in strategy.uplink_keys):,}",
        strategy.uplink_format)
    rounds = _Rounds(grid, strategy, cfg)

    def save_checkpoint(server_round: int) -> None:
        arrays, meta = strategy.state_dict()
        ckpt.save(out.path, server_round=server_round, cfg=cfg, arrays=arrays, meta=meta)

    if checkpoint is not None:
        strategy.load_state_dict(checkpoint.arrays, checkpoint.meta)
        first = checkpoint.round + 1
        log(INFO, "Resuming %s from its checkpoint after round %d (of %d)", out.path, checkpoint.round, cfg.rounds)
    else:
        # round 0: every client evaluates the initial global state
        rounds.ensure_nodes()
        replies = rounds.send(0, "evaluate", strategy.configure_evaluate(0, ArrayRecord(), ConfigRecord(), grid))
        strategy.aggregate_evaluate(0, replies)
        save_checkpoint(0)
        first = 1

    # the strategy encodes its own downlink (its wire format, its active experts) once per phase:
    # configure_* get an empty ArrayRecord rather than a second encoding to throw away
    t_start = time.time()
    for server_round in range(first, int(cfg.rounds) + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", server_round, cfg.rounds)
        rounds.ensure_nodes()
        messages = strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid)
        # the strategy's exchange: one (train) or, under secure aggregation, its stages (strategies.exchange)
        strategy.exchange.run(server_round, messages, rounds.send)
        rounds.ensure_nodes()
        messages = strategy.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid)
        strategy.aggregate_evaluate(server_round, rounds.send(server_round, "evaluate", messages))
        save_checkpoint(server_round)
    log(INFO, "rounds %d..%d finished in %.1f s", first, cfg.rounds, time.time() - t_start)

    extra = plan.save_final(strategy.global_state, out.path) or {}
    extra["missing_replies"] = sum(len(r.get("missing", [])) for r in strategy.history)
    if getattr(strategy, "privacy", None) is not None:  # ε spent by the whole run (dp-accounting)
        extra["privacy"] = strategy.release.record()
        log(INFO, "differential privacy (%s): ε = %.3g at δ = %g after %d noised rounds (noise multiplier %.3g)",
            strategy.privacy.mode, extra["privacy"]["epsilon"], strategy.privacy.delta, strategy.release.released,
            strategy.privacy.noise_multiplier)
    if checkpoint is not None:
        extra["resumed_after_round"] = checkpoint.round
    return out.finish(strategy.history, extra)
