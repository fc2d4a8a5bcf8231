"""#61: the client side of differential privacy and secure aggregation as one Flower mod
(fedapps.private_reply): what a private run's training reply may carry, whatever the method's handler put in it."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedapps.config import compose, to_yaml
from fedapps.private_reply import private_reply
from fedapps.session import ClientSetupError, reply
from strategies import codec
from strategies.screening import CONFIG_RECORD

DOWN = {"w": np.zeros(8, np.float32)}


def _message(cfg, kind="train") -> Message:
    content = RecordDict({"arrays": codec.encode(DOWN, "fp32"), "config": ConfigRecord({"server-round": 1}),
                          CONFIG_RECORD: ConfigRecord({"yaml": to_yaml(cfg)})})
    return Message(content, dst_node_id=5, message_type=kind)


def _context() -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                   run_config={})


def _handler(arrays=True):
    """What a method's train handler replies: its metrics (loss, timing, partition id) and a large update."""
    def handle(msg, context):
        out = reply(msg, {"num-examples": 37, "loss": 1.25, "partition-id": 0, "client-seconds": 3.0},
                    codec.encode({"w": np.full(8, 5.0, np.float32)}, "fp32") if arrays else None)
        return out
    return handle


def test_a_private_runs_reply_carries_a_clipped_update_and_one_example_only():
    cfg = compose(["privacy.mode=local", "privacy.noise_multiplier=0.001", "privacy.seed=1", "algorithm.uplink=delta"],
                  preset="test")
    out = private_reply(_message(cfg), _context(), _handler())
    assert dict(out.content["metrics"]) == {"num-examples": 1}  # no loss, timing or partition id in clear
    update = codec.decode(out.content["arrays"])["w"]
    assert np.linalg.norm(update) == pytest.approx(float(cfg.privacy.clip), rel=0.05)  # clipped (and noised)


def test_a_plain_run_and_every_other_message_pass_through_untouched():
    plain = compose([], preset="test")
    out = private_reply(_message(plain), _context(), _handler())
    assert out.content["metrics"]["loss"] == 1.25
    private = compose(["privacy.mode=local", "privacy.noise_multiplier=1.0"], preset="test")
    evaluated = private_reply(_message(private, "evaluate"), _context(), _handler(arrays=False))
    assert evaluated.content["metrics"]["loss"] == 1.25  # evaluation replies are the server's to aggregate


def test_a_private_reply_without_an_update_record_is_refused_not_sent():
    cfg = compose(["privacy.mode=local", "privacy.noise_multiplier=1.0"], preset="test")
    with pytest.raises(ClientSetupError, match="must carry its update as 'arrays'"):
        private_reply(_message(cfg), _context(), _handler(arrays=False))
