"""FLITE's strategy: FedAvg of latent vectors, refusing latents from another parametrisation.

Because ``θ = θ_pre + U Vᵀ z`` is affine in ``z`` with factors every party regenerates
from the same seed, averaging the clients' latents is exactly averaging the weights they
generate. A latent only means something under the same (seed, backbone, layout): each
reply carries the fingerprint of the client's parametrisation, and a mismatch is refused
before its numbers are read.

Two reply forms (``algorithm.reply``): ``full`` — z in the ArrayRecord ``arrays``, the
metrics (loss, partition id, timings) and the fingerprint record; ``compact`` — one
ConfigRecord ``z`` holding z's wire bytes and ``num-examples``, nothing else (1,669
bytes on Flower 1.42's wire in a deployment against 3,106; Flower's own floor, z alone, is
1,648: ``bench/wire_bytes.py``). A compact reply drops
the training metrics and leaves the fingerprint to the client, which refuses to train
under a server whose fingerprint differs from its own (``fedapps.flite``); the server
rebuilds z's Array from the run's layout and wire format and screens it like any other.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from strategies import codec
from strategies.base import PayloadFedAvg
from strategies.screening import NUM_EXAMPLES, positive_count
from strategies.codec import PayloadError

LATENT_KEY = "z"
FINGERPRINT_RECORD = "flite"  # the reply's ConfigRecord carrying the client's fingerprint
FINGERPRINT_KEY = "flite-fingerprint"  # the train/evaluate config key carrying the server's
COMPACT_RECORD = "z"  # a compact reply's one ConfigRecord: z's wire bytes and num-examples (a short name: bytes)
REPLY_FORMS = ("full", "compact")


def compact_content(record: ArrayRecord, num_examples: int) -> RecordDict:
    """A compact training reply: the bytes of z's one Array and ``num-examples``, in one ConfigRecord."""
    if list(record) != [LATENT_KEY]:
        raise ValueError(f"a compact FLITE reply carries z alone, got {list(record)}")
    return RecordDict({COMPACT_RECORD: ConfigRecord({LATENT_KEY: record[LATENT_KEY].data,
                                                    NUM_EXAMPLES: int(num_examples)})})


class FliteStrategy(PayloadFedAvg):
    """``uplink='delta'`` (default): clients send ``z_local − z_received`` (small values, so
    int4's 16 levels resolve them far better than absolute latents); the server adds the
    weighted mean update to its fp32 ``z``. ``uplink='absolute'``: clients send ``z`` and
    the server averages it. Both give the same global ``z`` in fp32."""

    @staticmethod
    def check_reply(reply: str, private: bool) -> None:
        """FLITE's reply form (``algorithm.reply``) for a run that is ``private`` (secure aggregation or
        differential privacy) or not; ValueError naming the fix. The config check and the strategy both ask here."""
        if reply not in REPLY_FORMS:
            raise ValueError(f"reply must be one of {list(REPLY_FORMS)}, got {reply!r}")
        if reply == "compact" and private:
            raise ValueError("reply=compact: a compact reply carries z's bytes alone (no room for masks or noise "
                             "bookkeeping), not with secure aggregation or differential privacy; use reply=full")

    def __init__(self, *, fingerprint: str, uplink: str = "delta", reply: str = "full", **kwargs) -> None:
        if not fingerprint:
            raise ValueError("FLITE needs the fingerprint of its parametrisation")
        self.check_reply(reply, kwargs.get("secure") is not None or kwargs.get("privacy") is not None)
        super().__init__(uplink=uplink, **kwargs)
        if self.uplink_keys != [LATENT_KEY]:
            raise ValueError(f"FLITE federates one latent vector '{LATENT_KEY}', got keys {self.uplink_keys}")
        self.fingerprint = fingerprint
        self.reply = reply

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        config[FINGERPRINT_KEY] = self.fingerprint
        return super().train_config_for(server_round, node_id, config)

    # -------------------------------------------------------------- the compact reply form
    def _compact(self, msg: Message) -> ConfigRecord | None:
        """A training reply's compact record if this run's replies are compact (PayloadError if the
        reply is not exactly that form), None for a full-form run."""
        content = msg.content
        if self.reply == "full":
            if COMPACT_RECORD in content.config_records:
                raise PayloadError(f"a compact reply ('{COMPACT_RECORD}'), but this run's replies are full "
                                   "(algorithm.reply=full)")
            return None
        others = sorted(k for k in content if k != COMPACT_RECORD)
        if COMPACT_RECORD not in content.config_records or others:
            raise PayloadError(f"this run's replies are compact: one ConfigRecord '{COMPACT_RECORD}' and nothing "
                               f"else (got {sorted(content)[:4]})")
        record = content.config_records[COMPACT_RECORD]
        if sorted(record) != sorted((LATENT_KEY, NUM_EXAMPLES)) or not isinstance(record[LATENT_KEY], bytes):
            raise PayloadError(f"a compact reply holds '{LATENT_KEY}' (bytes) and '{NUM_EXAMPLES}', got "
                               f"{sorted(record)[:4]}")
        return record

    def reply_metrics(self, msg: Message, phase: str = "train") -> dict:
        record = self._compact(msg) if phase == "train" else None
        if record is None:
            return super().reply_metrics(msg, phase)
        return {NUM_EXAMPLES: positive_count(record[NUM_EXAMPLES])}

    def reply_record(self, msg: Message) -> tuple[ArrayRecord, int]:
        record = self._compact(msg)
        if record is None:
            return super().reply_record(msg)
        (shape,) = self.layout().values()
        arrays = ArrayRecord()
        arrays[LATENT_KEY] = Array(dtype="float32", shape=tuple(shape), stype=codec.FORMATS[self.uplink_format],
                                   data=record[LATENT_KEY])
        return arrays, positive_count(record[NUM_EXAMPLES])

    def check_reply_records(self, msg):
        if self._compact(msg) is not None:  # the client checked the server's fingerprint against its own
            return
        record = msg.content.config_records.get(FINGERPRINT_RECORD)
        got = None if record is None else record.get("fingerprint")
        if got != self.fingerprint:
            raise PayloadError(f"latent fingerprint {got!r} does not match the server's {self.fingerprint!r} "
                               "(different seed, backbone or latent layout)")
