"""The server's side of a secure round, as a collaborator of :class:`~strategies.base.PayloadFedAvg`.

The runner drives a secure round as ``begin -> keys -> shares -> deliver [-> open] -> upload -> finish``
(:mod:`strategies.secure_round` is the protocol on Flower messages; :meth:`SecureStages.step` picks the
step by the phase just answered); each step takes the previous stage's replies and returns the next
stage's messages (``[]`` once the round is abandoned: below the threshold). ``open`` runs only when a
holder complained about a share: each complaint is settled there and the convicted node excluded. Each stage's replies are screened as any reply is
(:mod:`strategies.screening`); a node whose key, share or reveal is bad is dropped from the
round and refused by name; a provable cheat is excluded from the run (``strategy.ban``).
:meth:`SecureStages.finish` hands the revealed sum of the uploaders' masked updates to the
strategy's release stage (``strategy.release.of_sum``) and its one tail (``strategy.conclude``), which commits it as any
round's; before that, the mean's values are checked against ``robust.max_abs`` and the method's own bounds (a round whose
mean proposes values beyond them is refused: a mean of honest proposals stays inside, up to one quantisation step).
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import Message
from flwr.common.logger import log

from strategies import codec
from strategies.codec import PayloadError
from strategies.screening import CONFIG_RECORD, NUM_EXAMPLES, screen
from strategies.secagg import SecAggCheat, SecAggError
from strategies.secure_round import DELIVER, KEYS, OPEN, SHARES, UNMASK, SecureRound, SecureSettings


class SecureStages:
    """One run's secure rounds, on behalf of ``strategy`` (its ledger, sent messages, reply checks)."""

    def __init__(self, strategy, settings: SecureSettings) -> None:
        self.strategy = strategy
        self.settings = settings
        self.round: SecureRound | None = None
        self.train: list[Message] = []  # the method's training messages, the final participants' keys attached
        self.metrics: list[dict] = []  # what is kept of each upload's metrics: its count, nothing else
        self.noted: set[int] = set()  # nodes whose leaving this round is already recorded

    @property
    def ledger(self):
        return self.strategy.ledger

    # ------------------------------------------------------------------ the stages
    def run(self, server_round: int, messages: list[Message], send) -> None:
        """A training round under secure aggregation (the runner's exchange, ``strategies.exchange``): keys,
        shares, the shares' delivery (and, after a complaint, the accused dealers' opening), the masked training
        replies, unmasking; each stage's replies (``send(server_round, phase, messages)``) make the next stage's
        messages."""
        messages = self.begin(server_round, messages)
        while messages and messages[0].metadata.message_type != UNMASK:  # keys, shares, deliver, [open], train
            phase = messages[0].metadata.message_type
            messages = self.step(phase, server_round, send(server_round, phase, messages))
        self.finish(server_round, send(server_round, UNMASK, messages))

    def begin(self, server_round: int, train_messages: list[Message]) -> list[Message]:
        """The method's training messages -> the keys stage's messages (the run's config rides along)."""
        self.ledger.start(server_round)
        self.train = list(train_messages)
        self.noted = set()
        try:
            self.round = SecureRound(self.settings, server_round, [int(m.metadata.dst_node_id) for m in self.train],
                                     self.strategy.layout())
        except SecAggError as err:
            return self._abandon(err)
        out = self.round.keys_messages()
        for msg, train in zip(out, self.train):  # a node that needs the run's config gets it first here
            if CONFIG_RECORD in train.content.config_records:
                msg.content[CONFIG_RECORD] = train.content[CONFIG_RECORD]
        return self._sent(KEYS, out)

    def keys(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The nodes' public keys -> the shares stage's messages."""
        taken, out = self._take(KEYS, SecureRound.take_keys, replies)
        return self._sent(SHARES, out) if taken else []

    def shares(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The nodes' encrypted shares -> the deliver stage's messages, each with the shares addressed to its node."""
        taken, _ = self._take(SHARES, SecureRound.take_shares, replies)
        return self._sent(DELIVER, self.round.deliver_messages()) if taken else []

    def deliver(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The holders' complaints -> the open stage's messages to the accused dealers, or, with no complaint,
        the training messages."""
        taken, out = self._take(DELIVER, SecureRound.take_deliver, replies)
        if not taken:
            return []
        return self._sent(OPEN, out) if out else self._training()

    def open(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The accused dealers' opened keys -> each complaint settled (the convicted node excluded from the
        run, the evidence in the round's record) -> the training messages of the final participants."""
        secure = self.round
        taken, _ = self._take(OPEN, SecureRound.take_open, replies)
        if secure is not None:
            for node, why in sorted(secure.convicted.items()):
                self.strategy.ban(node, f"secure aggregation, round {server_round}: {why}")
            if secure.evidence:
                self.ledger.current.setdefault("secure_evidence", []).extend(secure.evidence)
        return self._training() if taken else []

    def step(self, phase: str, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The next messages of a secure round after the replies to ``phase`` (the runner's loop)."""
        steps = {KEYS: self.keys, SHARES: self.shares, DELIVER: self.deliver, OPEN: self.open, "train": self.upload}
        return steps[phase](server_round, replies)

    def _training(self) -> list[Message]:
        """The method's training messages of the final participants, each with their keys (what it masks with)."""
        secure = self.round
        before = {id(m): codec.message_bytes(m.content) for m in self.train}
        out = [m for m in (secure.attach(m) for m in self.train) if m is not None]
        for msg in out:
            self.ledger.add_bytes(int(msg.metadata.dst_node_id), "secagg_downlink_bytes",
                                  codec.message_bytes(msg.content) - before[id(msg)])
        self.strategy.sent["train"] = out
        return out

    def upload(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The masked training replies (screened as any reply, then their masked layout) -> unmask messages."""
        if self.round is None:
            return []
        strategy = self.strategy
        self.metrics = []
        for reply in strategy.screen(replies, "train"):
            try:
                strategy.check_reply_records(reply.msg)
                record, _ = strategy.reply_record(reply.msg)
                residues = self.round.check_upload(record)
            except (PayloadError, SecAggError) as err:
                self.ledger.refuse(reply.node, str(err), kind="payload")
                continue
            except Exception as err:  # noqa: BLE001 - whatever a client sends must not stop the run
                self.ledger.refuse(reply.node, f"malformed payload ({type(err).__name__}: {err})", kind="payload")
                continue
            self.round.upload(reply.node, residues)
            self.metrics.append({NUM_EXAMPLES: reply.metrics[NUM_EXAMPLES]})  # nothing else of it is kept
            strategy.ledger.uploaded(reply.node, record, reply.msg, None)
        try:
            out = self.round.unmask_messages()
        except SecAggError as err:
            return self._abandon(err)
        return self._sent(UNMASK, out)

    def finish(self, server_round: int, replies: Iterable[Message]):
        """The unmask replies -> the mean of the uploaders' updates (uniform weights) through the strategy's
        aggregation tail; ``(None, None)`` when the round cannot be finished (the state unchanged)."""
        out = self._finish(server_round, replies)
        self.strategy.train_ended(server_round)
        return out

    def _finish(self, server_round: int, replies: Iterable[Message]):
        secure, self.round = self.round, None
        if secure is None:
            return None, None
        try:
            sums = secure.take_reveals(self._replies(replies, UNMASK))
        except SecAggError as err:
            for node, why in (err.culprits.items() if isinstance(err, SecAggCheat) else ()):
                self.strategy.ban(node, f"secure aggregation, round {server_round}: {why}")
            return self._abandon(err) or (None, None)
        finally:
            self._note_drops(UNMASK, secure)
        count = len(secure.masked)
        self.ledger.current["secure"] = {
            "uploaded": count, "participants": len(secure.participants), "threshold": secure.threshold,
            "bits": secure.fixed.bits, "modulus_bits": secure.fixed.modulus_bits, "clip": secure.fixed.clip,
            "dropped": {str(k): v for k, v in secure.dropped.items()}, "out_of_range": secure.outside}
        if secure.outside:
            log(WARNING, "round %s: %d values of the secure sum lay outside what %d honest clients can send: a "
                "client masked values outside the encoding's range (it cannot be named under masking); brought "
                "into the range", server_round, secure.outside, count)
        # clients always mask their update (what they trained minus what they received), whatever
        # the method's uplink: updates are small, so a narrow clip range resolves them
        strategy = self.strategy
        try:  # the value bounds hold for a mean of honest proposals (convex), up to one quantisation step
            strategy.check_values(strategy.with_update({k: v / count for k, v in sums.items()}),
                                  slack=secure.fixed.step)
        except PayloadError as err:
            strategy.ledger.refuse(None, f"secure aggregation: the mean of {count} masked updates {err}: a client "
                                         "masked values beyond the bounds; the round is refused", kind="round")
            return None, None
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite aggregate is refused in conclude
            update = strategy.release.of_sum(strategy, server_round, sums, count)
        return strategy.conclude(server_round, update, self.metrics, [1] * count)

    # ------------------------------------------------------------------ helpers
    def _take(self, phase: str, take, replies: Iterable[Message]) -> tuple[bool, object]:
        """A stage's replies handed to ``take`` (a :class:`SecureRound` method): (True, its result), or
        (False, None) when there is no round or it is abandoned (below the threshold); either way the
        nodes the stage dropped are refused by name."""
        secure = self.round
        if secure is None:
            return False, None
        try:
            return True, take(secure, self._replies(replies, phase))
        except SecAggError as err:
            self._abandon(err)
            return False, None
        finally:
            self._note_drops(phase, secure)

    def _replies(self, replies: Iterable[Message], phase: str) -> dict[int, Message]:
        """A stage's replies by node: client errors and identity problems refused (as any reply's);
        sizes and contents are checked by the stage itself."""
        out: dict[int, Message] = {}
        for reply in screen(replies, sent=self.strategy.sent.get(phase, []), phase=phase, refuse=self.ledger.refuse,
                            on_error=self.strategy.node_lost, all_failed_raises=False):
            out[reply.node] = reply.msg
            try:
                self.ledger.add_bytes(reply.node, "secagg_uplink_bytes", codec.message_bytes(reply.msg.content))
            except Exception:  # noqa: BLE001 - a measurement
                pass
        return out

    def _sent(self, phase: str, messages: list[Message]) -> list[Message]:
        for msg in messages:
            self.ledger.add_bytes(int(msg.metadata.dst_node_id), "secagg_downlink_bytes",
                                  codec.message_bytes(msg.content))
        self.strategy.sent[phase] = messages
        return messages

    def _note_drops(self, phase: str, secure: SecureRound) -> None:
        """Nodes the secure round dropped for what they sent (a bad key, share, reveal): each refused by name."""
        for node, why in sorted(secure.dropped.items()):
            if node not in self.noted:
                self.noted.add(node)
                self.ledger.refuse(node, f"secure aggregation: {why}", kind="secagg", phase=phase)

    def _abandon(self, err: Exception) -> list:
        self.round = None
        self.ledger.refuse(None, f"secure aggregation: {err}", kind="round")
        return []

