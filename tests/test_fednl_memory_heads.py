"""FedNL with one memory per key/value head (``memory_heads="kv"``) on a tiny GQA Llama (4 query heads,
2 key/value heads): the same model as one memory per query head whose β is repeated within each group,
and streaming works as it does per query head (generation with the cache and padding: test_fednl_model's
tests, run in both modes)."""

import copy

import pytest
import torch

from clients.fednl import FedNLConfig, FedNLStreamer, add_delta_memory, memory_attentions, stream_logits
from clients.fednl.layer import LayerStream

from test_fednl_model import tiny_llama, tokens, with_memory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_one_beta_per_key_value_head(llama):
    model = add_delta_memory(copy.deepcopy(llama), FedNLConfig(memory_heads="kv"))
    beta = memory_attentions(model)[0].fednl_beta
    assert beta.weight.shape == (2, 64) and beta.bias.shape == (2,)
    query = add_delta_memory(copy.deepcopy(llama), FedNLConfig(memory_heads="query"))
    assert memory_attentions(query)[0].fednl_beta.weight.shape == (4, 64)
    with pytest.raises(ValueError, match="memory_heads must be one of"):
        FedNLConfig(memory_heads="heads")


def test_kv_memories_equal_query_memories_with_beta_repeated(llama):
    """Per query head with each group's β copied from its key/value head == per key/value head:
    logits and the gradients of every shared parameter (LoRA-free: the gates; β summed over the group)."""
    kv = with_memory(llama, memory_heads="kv", chunk_size=16)
    query = with_memory(llama, memory_heads="query", chunk_size=16)
    with torch.no_grad():
        for a_kv, a_q in zip(memory_attentions(kv), memory_attentions(query)):
            a_q.fednl_beta.weight.copy_(a_kv.fednl_beta.weight.repeat_interleave(2, dim=0))
            a_q.fednl_beta.bias.copy_(a_kv.fednl_beta.bias.repeat_interleave(2, dim=0))
    ids = tokens(2, 40)  # 2 chunks of 16 and an incomplete one
    kv.train(), query.train()
    loss_kv, loss_q = kv(ids, labels=ids).loss, query(ids, labels=ids).loss
    assert abs(loss_kv.item() - loss_q.item()) <= 1e-5
    loss_kv.backward(), loss_q.backward()
    for a_kv, a_q in zip(memory_attentions(kv), memory_attentions(query)):
        assert (a_kv.fednl_gate.grad - a_q.fednl_gate.grad).abs().max() <= 1e-5
        summed = a_q.fednl_beta.weight.grad.unflatten(0, (2, 2)).sum(1)
        assert (a_kv.fednl_beta.weight.grad - summed).abs().max() <= 1e-5
        assert a_kv.fednl_beta.weight.grad.abs().max() > 0


@pytest.mark.parametrize("window", [None, 24])
def test_kv_streaming_in_blocks_equals_one_full_forward(llama, window):
    model = with_memory(llama, memory_heads="kv", window=window, chunk_size=32)
    ids = tokens(2, 150)
    with torch.no_grad():
        full = model(ids).logits
    for form in ("recurrent", "chunked"):
        assert (stream_logits(model, ids, block=64, form=form) - full).abs().max() <= 1e-4
    streamer = FedNLStreamer(model, block=64)
    streamer.step(ids[:, :10])
    memory = streamer.states[0].memory
    assert isinstance(streamer.states[0], LayerStream) and memory.shape == (2, 2, 16, 16)  # (B, KV, d_v, d_k)


def test_a_bad_memory_heads_fails_when_the_config_is_composed():
    from fedapps.config import ConfigError, compose
    from fedapps.fednl import memory_config

    with pytest.raises(ConfigError, match=r"^invalid algorithm.memory: memory_heads must be one of \('kv', 'query'\)"):
        compose(["algorithm.memory.memory_heads=heads"], algorithm="fednl")
    assert memory_config(compose(["algorithm.memory.memory_heads=kv"], algorithm="fednl")).memory_heads == "kv"
