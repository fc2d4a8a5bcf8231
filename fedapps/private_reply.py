"""A private run's training reply, on the node: one Flower mod, as Flower's own differential privacy
and SecAgg+ are mods (``flwr.clientapp.mod``).

:func:`private_reply` wraps every handler of Postcard's ClientApp and acts on training replies only
(``train``; secure aggregation's own stages, ``train.secagg_*``, and evaluation pass through). With
differential privacy the update is clipped, and in local mode noised (``fedapps.privacy``), before
it leaves; with secure aggregation it is masked (``fedapps.secure``); with either, the reply's
metrics are only ``num-examples: 1`` — no loss, norm, timing or partition id in clear, one example
(the server weighs private replies uniformly). A method's reply without an ``arrays`` record (FLITE's
compact reply, refused with both when the config is composed) is refused here too: nothing leaves
unprotected. docs/privacy.md lists what a client still reveals.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict

from fedapps import privacy, secure
from fedapps.method import round_seed
from fedapps.session import ClientSetupError, client_config, partition_of


def private_reply(msg: Message, context: Context, call_next) -> Message:
    """A Flower mod: a training reply of a run with differential privacy or secure aggregation, made private."""
    out = call_next(msg, context)
    if msg.metadata.message_type != MessageType.TRAIN or not out.has_content():
        return out
    cfg = secure.method_view(client_config(msg, context))
    dp, masking = privacy.settings_of(cfg), secure.settings_of(cfg)
    if dp is None and masking is None:
        return out
    if "arrays" not in out.content.array_records:
        raise ClientSetupError("a private run's training reply must carry its update as 'arrays' (this method's "
                               "own reply form cannot be clipped or masked)")
    server_round = int(msg.content["config"].get("server-round", 0))
    partition_id, _ = partition_of(context, cfg)
    seed = round_seed(cfg, server_round, partition_id)
    arrays = out.content["arrays"]
    if dp is not None:  # clipped (and in local mode noised) before it leaves, masked or not
        arrays = privacy.private_update(cfg, msg.content["arrays"], arrays, dp, server_round=server_round,
                                        partition_id=partition_id, seed=seed)
    if masking is not None:
        arrays = secure.masked_update(cfg, msg, context, arrays, seed)
    content = RecordDict({name: record for name, record in out.content.items() if name not in ("arrays", "metrics")})
    content["arrays"] = arrays
    content["metrics"] = MetricRecord({"num-examples": 1})
    return Message(content, reply_to=msg)
