"""The output layer in pieces: chunked next-token loss and last-position logits are exact."""

import pytest
import torch
import torch.nn.functional as F

from clients.models import build_model
from clients.models.llm import decoder_and_head, position_logits, token_loss
from fedapps.config import compose


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_model(compose(["model=tiny-llama"], algorithm="fedavg-full"))
    model.requires_grad_(True)
    return model


def batch(vocab, rows=3, tokens=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 7, 32, 63, 64, 1000])
def test_chunked_loss_and_gradients_equal_the_full_logits(tiny, chunk):
    ids, labels = batch(tiny.config.vocab_size)
    full = F.cross_entropy(tiny(input_ids=ids).logits.flatten(0, 1).float(), labels.flatten())
    reference = grads(tiny, full)
    chunked = token_loss(tiny, ids, labels, chunk_tokens=chunk)
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6)
    got = grads(tiny, chunked)
    assert got.keys() == reference.keys() and "model.embed_tokens.weight" in got  # tied to lm_head
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)  # float reassociation only
    with torch.no_grad():
        total = token_loss(tiny, ids, labels, chunk_tokens=chunk, reduction="sum")
    torch.testing.assert_close(total, full.detach() * labels.numel(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        per_token = token_loss(tiny, ids, labels, chunk_tokens=chunk, reduction="none")
        reference_tokens = F.cross_entropy(tiny(input_ids=ids).logits.flatten(0, 1).float(), labels.flatten(),
                                           reduction="none").view(labels.shape)
    torch.testing.assert_close(per_token, reference_tokens, rtol=1e-5, atol=1e-5)


def test_the_full_logits_never_exist_only_chunks_of_them(tiny):
    """The output layer sees at most ``chunk`` tokens per call, in forward and in backward."""
    decoder, head = decoder_and_head(tiny)
    assert head is tiny.lm_head and decoder is tiny.model
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0] if i[0].ndim == 2 else -1))
    try:
        ids, labels = batch(tiny.config.vocab_size, rows=4, tokens=50)
        token_loss(tiny, ids, labels, chunk_tokens=16).backward()
    finally:
        hook.remove()
    assert seen and max(seen) <= 16 and sum(seen) == 2 * 200  # each chunk run in forward and again in backward


def test_through_peft_lora_the_same_loss_and_adapter_gradients():
    from clients.adapters import apply_lora

    cfg = compose(["model=tiny-llama"], algorithm="fedavg-lora")
    model, _ = build_model(cfg)
    model = apply_lora(model, cfg.algorithm.lora, seed=0)
    with torch.no_grad():  # B = 0 at init: give the adapters a value so their gradients are not trivial
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    ids, labels = batch(model.config.vocab_size, seed=1)
    reference = grads(model, F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1).float(), labels.flatten()))
    got = grads(model, token_loss(model, ids, labels, chunk_tokens=10))
    assert got.keys() == reference.keys() and any("lora_A" in n for n in got)
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)  # float reassociation only


def test_position_logits_are_the_full_logits_at_those_positions_with_right_padding(tiny):
    ids, _ = batch(tiny.config.vocab_size, rows=3, tokens=12, seed=2)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # right padding, as the MMLU and NIAH batches have
    mask[2, 10:] = 0
    last = torch.tensor([6, 11, 9])
    with torch.no_grad():
        full = tiny(input_ids=ids, attention_mask=mask).logits[torch.arange(3), last]
        got = position_logits(tiny, ids, mask, last)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)


def test_a_bad_reduction_is_refused(tiny):
    ids, labels = batch(tiny.config.vocab_size, rows=1, tokens=4)
    with pytest.raises(ValueError, match="reduction"):
        token_loss(tiny, ids, labels, reduction="max")
