"""FedNL: a delta-rule memory beside every attention layer of a frozen causal LM.

Laid out as flash-linear-attention and PEFT lay out a method:

* :mod:`clients.fednl.deltarule` (ops): the delta rule, a naive recurrent reference
  beside the chunked (WY/UT) form and fla's kernel;
* :mod:`clients.fednl.config`: :class:`FedNLConfig`, the settings;
* :mod:`clients.fednl.layer`: the dual-path (softmax + memory) attention forward;
* :mod:`clients.fednl.model`: installing it on a HF model, and the names of θ;
* :mod:`clients.fednl.stream`: block-by-block streaming (FedNL and KV-cache streamers);
* :mod:`clients.fednl.diagnostics`: streaming cross-entropy per 1K bin, peak memory.
"""

from clients.fednl.config import FedNLConfig
from clients.fednl.deltarule import delta_rule_chunked, delta_rule_recurrent, l2_normalize, ut_transform
from clients.fednl.diagnostics import binned_nll, relative_ce
from clients.fednl.layer import BetaProjection
from clients.fednl.model import (
    PAYLOAD_MODES,
    add_delta_memory,
    is_memory_param,
    is_qkv_lora_param,
    mark_trainable,
    memory_attentions,
    memory_gate_values,
    meta_rule_names,
)
from clients.fednl.stream import FedNLStreamer, KVCacheStreamer, stream_logits, stream_token_nll, streamed_nll

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
