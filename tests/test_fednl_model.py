"""FedNL dual-path attention on tiny random-init Llama / Qwen2 models."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from clients.fednl import (
    FedNLConfig,
    FedNLStreamer,
    add_delta_memory,
    centre_keys,
    mark_trainable,
    memory_attentions,
    memory_gate_values,
    meta_rule_names,
    stream_logits,
    stream_token_nll,
)

torch.set_num_threads(1)

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=4096,
)


def tiny_llama(attn_implementation="sdpa", seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(**TINY)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(**TINY)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).eval()


def with_memory(backbone, **kwargs):
    """A copy of ``backbone`` with the memory, alpha = 0.5 and input-dependent beta."""
    kwargs.setdefault("gate_init_logit", 0.0)
    model = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(**kwargs))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for attn in memory_attentions(model):
            attn.fednl_beta.weight.copy_(torch.randn(attn.fednl_beta.weight.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def tokens(batch, length, seed=0):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- alpha = 0 is the backbone
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_alpha_zero_gives_the_backbone_exactly(implementation):
    backbone = tiny_llama(implementation)
    ids = tokens(2, 50)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    with torch.no_grad():
        expected = backbone(ids).logits
        expected_masked = backbone(ids, attention_mask=mask).logits
        model = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(gate_init_logit=float("-inf")))
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(model(ids, attention_mask=mask).logits, expected_masked)
        very_negative = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(gate="channel", gate_init_logit=-30.0))
        assert (very_negative(ids).logits - expected).abs().max() <= 1e-5
        mixed = with_memory(backbone)
        assert (mixed(ids).logits - expected).abs().max() > 1e-3  # the memory does change the output


def test_qwen2_gets_the_memory_too():
    backbone = tiny_qwen2()
    ids = tokens(1, 40)
    with torch.no_grad():
        expected = backbone(ids).logits
        model = add_delta_memory(copy.deepcopy(backbone), FedNLConfig(gate_init_logit=float("-inf")))
        assert torch.equal(model(ids).logits, expected)
        mixed = with_memory(backbone, window=16)
        assert len(memory_attentions(mixed)) == 2
        assert (stream_logits(mixed, ids, block=16) - mixed(ids).logits).abs().max() <= 1e-4


def test_new_parameters_are_named_initialised_and_alone_trainable(llama):
    model = add_delta_memory(copy.deepcopy(llama), FedNLConfig(gate="channel", gate_init_logit=-4.0, beta="constant"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == meta_rule_names(model, "gate")
    assert trainable == [
        f"model.layers.{i}.self_attn.{name}" for i in range(2) for name in ("fednl_gate", "fednl_beta.bias")
    ]
    assert model.model.layers[0].self_attn.fednl_gate.shape == (4 * 16,)
    assert memory_gate_values(model) == pytest.approx([torch.sigmoid(torch.tensor(-4.0)).item()] * 2)
    # backbone names are unchanged, so a plain checkpoint still loads
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all("fednl_" in name for name in missing)


def test_gradients_reach_gate_and_beta_but_not_the_backbone(llama):
    model = with_memory(llama, chunk_size=16)
    model.train()
    ids = tokens(2, 40)
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if "fednl_" in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


# --------------------------------------------------------------------------- LoRA with PEFT on top
def test_peft_lora_on_qkv_trains_with_the_memory(llama):
    model = with_memory(llama, chunk_size=16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]))
    trainable = mark_trainable(model)
    payload = meta_rule_names(model, "meta-rules")
    gate_only = meta_rule_names(model, "gate")
    assert trainable == payload
    assert len(gate_only) == 2 * 3 and all("fednl_" in n for n in gate_only)
    assert len(payload) == len(gate_only) + 2 * 3 * 2  # + lora_A/lora_B on q, k, v of 2 layers
    assert all(n.startswith("base_model.model.model.layers.") for n in payload)

    ids = tokens(2, 40)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if name in payload:
            assert param.grad is not None, name
            if "lora_A" not in name:  # lora_B starts at zero, so lora_A's first gradient is zero
                assert param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name

    # the dual-path forward calls the PEFT-wrapped projections: LoRA changes the output
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
        assert (model(input_ids=ids).logits - before).abs().max() > 1e-3


def test_payload_names_need_the_memory_and_lora(llama):
    with pytest.raises(ValueError, match="add_delta_memory"):
        meta_rule_names(llama, "gate")
    model = add_delta_memory(copy.deepcopy(llama))
    with pytest.raises(ValueError, match="LoRA"):
        meta_rule_names(model, "meta-rules")
    with pytest.raises(ValueError, match="mode"):
        meta_rule_names(model, "everything")


def test_the_window_keeps_the_sink_tokens_in_view(llama):
    """With the memory silent, a window whose sinks cover the whole sequence is the backbone's full
    attention; without sinks the same window is not; and a sink token's value reaches every later
    token only through the sinks."""
    ids = tokens(2, 60)
    with torch.no_grad():
        expected = llama(ids).logits
        silent = dict(gate_init_logit=float("-inf"), window=8)
        assert (add_delta_memory(copy.deepcopy(llama), FedNLConfig(**silent, sink=60))(ids).logits
                - expected).abs().max() <= 1e-5
        assert (add_delta_memory(copy.deepcopy(llama), FedNLConfig(**silent, sink=0))(ids).logits
                - expected).abs().max() > 1e-3
        changed = ids.clone()
        changed[:, 1] = (ids[:, 1] + 1) % 256  # token 1: a sink with sink=4, out of the window at 20+ otherwise
        for sink, moves in ((4, True), (0, False)):
            model = add_delta_memory(copy.deepcopy(llama), FedNLConfig(**silent, sink=sink))
            late = (model(changed).logits[:, 40:] - model(ids).logits[:, 40:]).abs().max().item()
            assert (late > 1e-4) == moves, (sink, late)
    with pytest.raises(ValueError, match="sink"):
        FedNLConfig(window=8, sink=-1)
    with pytest.raises(ValueError, match="sink"):
        FedNLConfig(window=8, sink=True)


# --------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("window,sink", [(None, 4), (100, 4), (24, 4), (24, 0), (24, 70)])
def test_streaming_in_blocks_equals_one_full_forward(llama, window, sink):
    model = with_memory(llama, window=window, chunk_size=32, sink=sink)
    ids = tokens(2, 300)  # 4 blocks of 64 and a short one of 44
    with torch.no_grad():
        full = model(ids).logits
    assert (stream_logits(model, ids, block=64) - full).abs().max() <= 1e-4
    assert (stream_logits(model, ids, block=64, form="chunked") - full).abs().max() <= 1e-4
    assert all(attn.fednl_stream is None for attn in memory_attentions(model))  # no mode left behind


def test_stream_token_nll_matches_full_cross_entropy(llama):
    model = with_memory(llama)
    ids = tokens(1, 130)
    with torch.no_grad():
        logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    nll = stream_token_nll(model, ids, block=64)
    assert nll.shape == (1, 129)
    assert (nll[0] - expected).abs().max() <= 1e-4


def test_streaming_state_does_not_grow_with_context(llama):
    window, block = 64, 256
    model = with_memory(llama, window=window)
    sizes = {}
    for length in (1024, 4096):
        streamer = FedNLStreamer(model, block=block)
        for _ in streamer.blocks(tokens(1, length)):
            pass
        sizes[length] = streamer.state_bytes()
        assert streamer.position == length
    # per layer: memory (1 x 2 kv heads x 16 x 16: memory_heads=kv) + sink and window keys and values
    # (1 x 2 kv heads x (4 + 64) x 16), float32
    per_layer = 4 * (2 * 16 * 16 + 2 * (2 * (4 + window) * 16))
    assert sizes[1024] == sizes[4096] == 2 * per_layer


# --------------------------------------------------------------------------- generation with the HF cache
@pytest.mark.parametrize("memory_heads", ["kv", "query"])
@pytest.mark.parametrize("window", [None, 8])  # 8: the cached steps see the 4 sinks and the last 8 tokens
def test_generate_with_cache_matches_recomputing_from_scratch(llama, window, memory_heads):
    model = with_memory(llama, chunk_size=8, window=window, memory_heads=memory_heads)
    prompt = tokens(1, 21)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        ids = prompt
        for _ in range(6):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)


@pytest.mark.parametrize("memory_heads", ["kv", "query"])
def test_padding_never_writes_to_the_memory(llama, memory_heads):
    model = with_memory(llama, memory_heads=memory_heads)
    ids = tokens(1, 30)
    padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones_like(ids)], dim=1)
    with torch.no_grad():
        alone = model(ids).logits
        batched = model(padded, attention_mask=mask).logits[:, 9:]
        ones = model(ids, attention_mask=torch.ones_like(ids)).logits  # an all-ones mask: nothing masked
    assert (alone - batched).abs().max() <= 1e-4
    assert torch.equal(alone, ones)


# --------------------------------------------------------------------------- key centring
def test_centred_keys_equal_the_naive_running_mean():
    key = torch.randn(2, 3, 11, 4, generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 1, 11, dtype=torch.bool)
    valid[1, 0, :4] = False  # left padding: neither counted nor moving the mean
    centred, (total, count) = centre_keys(key, valid)
    for b in range(2):
        real = [t for t in range(11) if valid[b, 0, t]]
        for t in real:
            seen = [u for u in real if u <= t]
            expected = key[b, :, t] - key[b, :, seen].mean(dim=1)
            assert torch.allclose(centred[b, :, t], expected, atol=1e-6)
        assert count[b].item() == len(real)
        assert torch.allclose(total[b], key[b, :, real].sum(dim=1), atol=1e-5)
    assert centred[0, :, 0].abs().max() == 0  # the first key is its own mean: it writes nothing
    # in two blocks, carrying (sum, count): the same keys
    first, stats = centre_keys(key[..., :5, :], valid[..., :5])
    second, _ = centre_keys(key[..., 5:, :], valid[..., 5:], stats)
    assert torch.allclose(torch.cat([first, second], dim=2), centred, atol=1e-6)


@pytest.mark.parametrize("window", [None, 24])
def test_key_centring_streams_generates_and_ignores_padding(llama, window):
    model = with_memory(llama, window=window, chunk_size=32, key_centering=True)
    ids = tokens(2, 200)
    with torch.no_grad():
        full = model(ids).logits
        plain = with_memory(llama, window=window, chunk_size=32)(ids).logits
    assert (full - plain).abs().max() > 1e-3  # the option changes the model
    assert (stream_logits(model, ids, block=64) - full).abs().max() <= 1e-4
    prompt = tokens(1, 21)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
        again = prompt
        for _ in range(5):
            again = torch.cat([again, model(again, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), prompt], dim=1)
        mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones_like(prompt)], dim=1)
        alone = model(prompt).logits
        batched = model(padded, attention_mask=mask).logits[:, 9:]
    assert torch.equal(generated, again)
    assert (alone - batched).abs().max() <= 1e-4


# --------------------------------------------------------------------------- a memory in some layers only
@pytest.mark.parametrize("window", [None, 24])
def test_layers_without_a_memory_run_the_softmax_path_alone(llama, window):
    from clients.fednl import dual_path_attentions

    model = with_memory(llama, window=window, chunk_size=32, layers=[1])
    assert [a.layer_idx for a in memory_attentions(model)] == [1] and len(dual_path_attentions(model)) == 2
    assert not any("layers.0." in n for n, _ in model.named_parameters() if "fednl_" in n)
    # layer 0 is the backbone's own attention (windowed as asked), whatever layer 1's memory does
    with torch.no_grad():
        ids = tokens(2, 150)
        backbone_like = with_memory(llama, window=window, chunk_size=32, layers=[1])
        memory_attentions(backbone_like)[0].fednl_gate.fill_(-100.0)
        assert torch.equal(backbone_like(ids).logits, with_memory(llama, window=window, chunk_size=32,
                                                                   gate_init_logit=-100.0)(ids).logits)
        full = model(ids).logits
    assert (stream_logits(model, ids, block=64) - full).abs().max() <= 1e-4
    names = meta_rule_names(get_peft_model(model, LoraConfig(target_modules=["q_proj", "k_proj", "v_proj"])))
    assert sum("fednl_gate" in n for n in names) == 1


def test_a_layer_the_model_lacks_is_refused(llama):
    with pytest.raises(ValueError, match=r"layers \[5\] are not among the model's attention layers 0..1"):
        add_delta_memory(copy.deepcopy(llama), FedNLConfig(layers=[1, 5]))


# --------------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"window": 0}, "window"),
        ({"gate": "vector"}, "gate"),
        ({"beta": "learned"}, "beta"),
        ({"qk_activation": "relu"}, "qk_activation"),
        ({"use_fla": "auto"}, "use_fla"),
        ({"gate_init_logit": float("nan")}, "gate_init_logit"),
        ({"key_centering": "yes"}, "key_centering"),
        ({"layers": []}, "layers"),
        ({"layers": [1, 1]}, "layers"),
        ({"layers": [-1]}, "layers"),
        ({"layers": 3}, "layers"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedNLConfig(**kwargs)


def test_bad_models_and_arguments_are_rejected(llama):
    with pytest.raises(ValueError, match="no self-attention"):
        add_delta_memory(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model = add_delta_memory(copy.deepcopy(llama))
    with pytest.raises(ValueError, match="already"):
        add_delta_memory(model)
    with pytest.raises(ValueError, match="no FedNL memory"):
        FedNLStreamer(llama)
    with pytest.raises(ValueError, match="block"):
        FedNLStreamer(model, block=0)
    with pytest.raises(ValueError, match="form"):
        FedNLStreamer(model, form="parallel")


def test_the_server_reports_each_gate_with_its_layer():
    import numpy as np

    from strategies.fednl import gate_alpha, gate_layers

    state = {"base_model.model.model.layers.12.self_attn.fednl_gate": np.array([0.0], dtype=np.float32),
             "base_model.model.model.layers.3.self_attn.fednl_gate": np.array([-100.0], dtype=np.float32),
             "base_model.model.model.layers.3.self_attn.fednl_beta.bias": np.zeros(2, dtype=np.float32)}
    assert gate_layers(state) == [3, 12]
    assert gate_alpha(state) == pytest.approx([0.0, 0.5])
