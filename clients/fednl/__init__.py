"""FedNL: a delta-rule memory beside every attention layer of a frozen causal LM.

* :mod:`clients.fednl.deltarule`: the delta rule, recurrent and chunked (WY/UT) forms.
* :mod:`clients.fednl.attention`: the dual-path (softmax + memory) attention, its
  installation on a HF model, the payload names and the streaming runner.
* :mod:`clients.fednl.diagnostics`: streaming cross-entropy per 1K bin, KV-cache streamer.
"""

from clients.fednl.attention import (
    PAYLOAD_MODES,
    BetaProjection,
    FedNLConfig,
    FedNLStreamer,
    add_delta_memory,
    is_memory_param,
    is_qkv_lora_param,
    mark_trainable,
    memory_attentions,
    memory_gate_values,
    meta_rule_names,
    stream_logits,
    stream_token_nll,
)
from clients.fednl.deltarule import delta_rule_chunked, delta_rule_recurrent, l2_normalize, ut_transform
from clients.fednl.diagnostics import KVCacheStreamer, binned_nll, relative_ce, streamed_nll

__all__ = [
    "PAYLOAD_MODES",
    "BetaProjection",
    "FedNLConfig",
    "FedNLStreamer",
    "KVCacheStreamer",
    "add_delta_memory",
    "binned_nll",
    "delta_rule_chunked",
    "delta_rule_recurrent",
    "is_memory_param",
    "is_qkv_lora_param",
    "l2_normalize",
    "mark_trainable",
    "memory_attentions",
    "memory_gate_values",
    "meta_rule_names",
    "relative_ce",
    "stream_logits",
    "stream_token_nll",
    "streamed_nll",
    "ut_transform",
]
