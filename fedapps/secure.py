"""Secure aggregation on a node: the ClientApp's stage answers and its masked training reply.

The protocol and its messages are ``strategies.secure_round``'s; this module reads the run's
settings from its configuration and keeps the node's secrets in ``context.state`` between
the stages of a round. Under secure aggregation a method hands its update to the mask layer
in fp32 (the payload format only sets the bits: int4 -> 4), and the client always masks
what it trained minus what it received.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message
from omegaconf import OmegaConf

from strategies.uplink import Wire, uplink_of
from fedapps.session import ClientSetupError, client_config
from strategies import codec
from strategies.secure_client import (client_deliver, client_keys, client_mask, client_open, client_shares,
                                      client_unmask)
from strategies.secure_round import DELIVER, KEYS, OPEN, RECORD, SHARES, UNMASK, SecureSettings



def auto_clip(cfg) -> float:
    """``clip: auto``: the most an AdamW update moves one value in a round, about the largest
    learning rate (``train.lr`` or a method's ``algorithm.lr.*``) per step, times the steps."""
    rates = [float(cfg.train.lr)] + [float(v) for v in (cfg.algorithm.get("lr") or {}).values() if v is not None]
    return max(rates) * int(cfg.train.local_steps)


def settings_of(cfg) -> SecureSettings | None:
    """The run's secure-aggregation settings (None when off), as server and clients both derive them."""
    block = cfg.get("secure_aggregation")
    if not block or not block.get("enabled"):
        return None
    return SecureSettings.from_config(block, Wire.of(cfg.algorithm).format, auto_clip(cfg))


def method_view(cfg):
    """The configuration a method trains under: with secure aggregation its payload in fp32 and
    the mask's bits resolved (the masks quantise once, to the run's shared range)."""
    settings = settings_of(cfg)
    if settings is None or Wire.of(cfg.algorithm).format == "fp32":
        return cfg
    view = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    view.algorithm.payload = "fp32"
    view.secure_aggregation.bits = int(settings.bits)
    OmegaConf.set_struct(view, True)
    return view


def answer_stage(msg: Message, context: Context) -> Message:
    """A ``train.secagg_*`` message: this node's part of the stage."""
    settings = settings_of(client_config(msg, context))
    if settings is None:
        raise ClientSetupError("the server sent a secure-aggregation stage, but this run has it off")
    kind = msg.metadata.message_type
    if kind == KEYS:
        content = client_keys(msg, context.state, settings)
    elif kind == SHARES:
        content = client_shares(int(context.node_id), msg, context.state, settings)
    elif kind == DELIVER:
        content = client_deliver(int(context.node_id), msg, context.state, settings)
    elif kind == OPEN:
        content = client_open(int(context.node_id), msg, context.state, settings)
    elif kind == UNMASK:
        content = client_unmask(int(context.node_id), msg, context.state, settings)
    else:
        raise ClientSetupError(f"unknown secure-aggregation stage {kind!r}")
    return Message(content=content, reply_to=msg)


def masked_update(cfg, msg: Message, context: Context, arrays: ArrayRecord, seed: int) -> ArrayRecord:
    """A training reply's ``arrays`` (the method's uplink), masked for this round (the training message
    ``msg`` carried the round's keys and shares). The fraction of values clipped to ±clip stays on the
    node (a private reply carries no metrics)."""
    if RECORD not in msg.content.config_records:
        raise ClientSetupError("this run has secure aggregation on, but the training message carries no "
                               "secure-aggregation record")
    settings = settings_of(cfg)
    values = codec.decode(arrays)
    if uplink_of(cfg.algorithm) != "delta":
        received = codec.decode(msg.content["arrays"])
        values = {k: v.astype(np.float64) - received[k] for k, v in values.items()}
    arrays, _ = client_mask(int(context.node_id), msg, context.state, settings, values, np.random.default_rng(seed))
    return arrays
