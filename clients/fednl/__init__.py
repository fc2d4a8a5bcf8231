"""FedNL: a delta-rule memory beside every attention layer of a frozen causal LM.

* :mod:`clients.fednl.deltarule`: the delta rule, recurrent and chunked (WY/UT) forms.
* :mod:`clients.fednl.attention`: the dual-path (softmax + memory) attention, its
  installation on a HF model, the payload names and the streaming runner.
"""

from clients.fednl.attention import (
    PAYLOAD_MODES,
    BetaProjection,
    FedNLConfig,
    FedNLStreamer,
    add_delta_memory,
    mark_trainable,
    memory_attentions,
    memory_gate_values,
    meta_rule_names,
    stream_logits,
    stream_token_nll,
)
from clients.fednl.deltarule import delta_rule_chunked, delta_rule_recurrent, l2_normalize, ut_transform

__all__ = [
    "PAYLOAD_MODES",
    "BetaProjection",
    "FedNLConfig",
    "FedNLStreamer",
    "add_delta_memory",
    "delta_rule_chunked",
    "delta_rule_recurrent",
    "l2_normalize",
    "mark_trainable",
    "memory_attentions",
    "memory_gate_values",
    "meta_rule_names",
    "stream_logits",
    "stream_token_nll",
    "ut_transform",
]
