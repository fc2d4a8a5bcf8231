"""FLITE's strategy: FedAvg of latent vectors, refusing latents from another parametrisation.

Because ``θ = θ_pre + U Vᵀ z`` is affine in ``z`` with factors every party regenerates
from the same seed, averaging the clients' latents is exactly averaging the weights they
generate. A latent only means something under the same (seed, backbone, layout): each
reply carries the fingerprint of the client's parametrisation, and a mismatch is refused
before its numbers are read.
"""

from __future__ import annotations

from flwr.app import ConfigRecord

from strategies.base import PayloadFedAvg
from strategies.codec import PayloadError

LATENT_KEY = "z"
FINGERPRINT_RECORD = "flite"  # the reply's ConfigRecord carrying the client's fingerprint
FINGERPRINT_KEY = "flite-fingerprint"  # the train/evaluate config key carrying the server's


class FliteStrategy(PayloadFedAvg):
    """``uplink='delta'`` (default): clients send ``z_local − z_received`` (small values, so
    int4's 16 levels resolve them far better than absolute latents); the server adds the
    weighted mean update to its fp32 ``z``. ``uplink='absolute'``: clients send ``z`` and
    the server averages it. Both give the same global ``z`` in fp32."""

    def __init__(self, *, fingerprint: str, uplink: str = "delta", **kwargs) -> None:
        if not fingerprint:
            raise ValueError("FLITE needs the fingerprint of its parametrisation")
        super().__init__(uplink=uplink, **kwargs)
        if self.uplink_keys != [LATENT_KEY]:
            raise ValueError(f"FLITE federates one latent vector '{LATENT_KEY}', got keys {self.uplink_keys}")
        self.fingerprint = fingerprint

    def train_config_for(self, server_round: int, node_id: int, config: ConfigRecord) -> ConfigRecord:
        config[FINGERPRINT_KEY] = self.fingerprint
        return super().train_config_for(server_round, node_id, config)

    def check_reply_records(self, msg):
        record = msg.content.config_records.get(FINGERPRINT_RECORD)
        got = None if record is None else record.get("fingerprint")
        if got != self.fingerprint:
            raise PayloadError(f"latent fingerprint {got!r} does not match the server's {self.fingerprint!r} "
                               "(different seed, backbone or latent layout)")
