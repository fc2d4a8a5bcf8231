"""Differential privacy on a node: its update clipped (and, in local mode, noised) before it leaves.

``strategies.privacy`` holds the mechanism and the accountant; this module applies them to
a method's training reply, whatever the method: it decodes the reply's arrays, takes the
update (what the node trained minus what it received; FLITE's delta uplink already is one),
clips it to ``privacy.clip`` in L2 norm, adds the local mode's noise, and encodes the
result back in the method's own format (an absolute uplink: received + clipped update).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from strategies import codec
from fedapps.resolved import client_count
from strategies.release import Sampling
from strategies.uplink import Wire, uplink_of
from strategies.privacy import Privacy, add_noise, clip_update



def settings_of(cfg) -> Privacy | None:
    """The run's privacy settings (None when off), as server and clients both derive them."""
    block = cfg.get("privacy")
    if not block or block.get("mode") in (None, "off", False):
        return None
    return Privacy.from_config(block, rounds=int(cfg.rounds), sample_rate=sample_rate(cfg))


def sample_rate(cfg) -> float:
    """The accountant's sampling rate q. With privacy on and ``fraction_train`` below 1, rounds sample
    Poisson at q = ``fraction_train`` (``Privacy.sample``: each node on its own, as dp-accounting's
    PoissonSampledDpEvent assumes); otherwise the fraction a round trains as Flower samples it,
    ``strategies.release.Sampling.train_size`` (``max(⌊N·fraction_train⌋, min_clients or 2)``) / N."""
    fraction = float(cfg.strategy.fraction_train)
    block = cfg.get("privacy")
    if block and block.get("mode") not in (None, "off", False) and fraction < 1.0:
        return fraction
    sampling = Sampling.from_mapping(cfg.strategy, client_count(cfg))
    return sampling.train_size / sampling.num_clients


def private_update(cfg, received: ArrayRecord, arrays: ArrayRecord, privacy: Privacy, *, server_round: int,
                   partition_id: int, seed: int) -> ArrayRecord:
    """A training reply's ``arrays`` with the update clipped (and noised in local mode); ``received``: the
    downlink it trained from. Its norm before clipping stays on the node (a private reply carries no
    metrics); a central-DP server records the norm it sees as ``update_norm``."""
    values = codec.decode(arrays)
    absolute = uplink_of(cfg.algorithm) != "delta"
    received = codec.decode(received) if absolute else {}
    delta = {k: v.astype(np.float64) - received[k] for k, v in values.items()} if absolute else values
    clipped, norm = clip_update(delta, privacy.clip)
    if privacy.mode == "local":
        clipped = add_noise(clipped, privacy.client_std, privacy.rng(server_round, partition_id))
    out = {k: (received[k] + v) if absolute else v for k, v in clipped.items()}
    fmt = Wire.of(cfg.algorithm).format
    return codec.encode(out, fmt, rng=np.random.default_rng(seed) if fmt in codec.QUANTISED else None)
