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

from clients.lazy import lazy_names

# each name's submodule, imported when the name is first used (clients.lazy)
_WHERE = {
    "FedNLConfig": "config",
    "delta_rule_chunked": "deltarule",
    "delta_rule_recurrent": "deltarule",
    "l2_normalize": "deltarule",
    "ut_transform": "deltarule",
    "binned_nll": "diagnostics",
    "relative_ce": "diagnostics",
    "BetaProjection": "layer",
    "centre_keys": "layer",
    "PAYLOAD_MODES": "model",
    "add_delta_memory": "model",
    "dual_path_attentions": "model",
    "is_memory_param": "model",
    "is_qkv_lora_param": "model",
    "mark_trainable": "model",
    "memory_attentions": "model",
    "memory_gate_values": "model",
    "meta_rule_names": "model",
    "FedNLStreamer": "stream",
    "KVCacheStreamer": "stream",
    "stream_logits": "stream",
    "stream_token_nll": "stream",
    "streamed_nll": "stream",
}


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = [
    "PAYLOAD_MODES",
    "BetaProjection",
    "FedNLConfig",
    "FedNLStreamer",
    "KVCacheStreamer",
    "add_delta_memory",
    "binned_nll",
    "centre_keys",
    "delta_rule_chunked",
    "delta_rule_recurrent",
    "dual_path_attentions",
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
