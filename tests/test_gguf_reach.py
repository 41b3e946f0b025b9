"""GGUF reach: every architecture, quant type and tokenizer the converter takes.

Each tiny GGUF is written here with the ``gguf`` package's writer, the way
llama.cpp's converter lays it out (its tensor names, Q/K row order, Gemma's
``1 + w`` norms, RoPE factor tensors), from the weights of the mlx-lm model of
the same family. Loaded as float32 (every tensor dequantized exactly), the
converted model's logits match that mlx-lm model on the same dequantized
weights; loaded as it is (K-quants and other types re-quantized to MLX's affine
4 or 8 bits), they agree within what ``docs/models.md`` documents.
The SentencePiece vocabularies are trained here with the ``sentencepiece``
library, which is the reference their tokens are held to.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes
from mlx_nursery.actors.models.gguf import converted
from mlx_nursery.actors.models.load import load_model
from test_gguf import permute, reference_logits, write_gguf

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 64, 512, 2
# Logits of a re-quantized model against the exact (dequantized) one: their
# cosine similarity (:func:`agreement`) is at least this. The per-type floors
# are measured worst cases: blocks of random bytes, every level used; real
# weights agree better (docs/models.md: Gemma 3 270M's Q4_K_M file).
AGREEMENT = 0.999  # Q4_K layers (see mixed_types)
# What each type becomes (the rest: 4 bits in groups of 32).
WIDTHS = {
    "Q5_0": {"group_size": 32, "bits": 8}, "Q5_1": {"group_size": 32, "bits": 8},
    "Q5_K": {"group_size": 32, "bits": 8}, "Q6_K": {"group_size": 64, "bits": 8},
}  # fmt: skip
TYPE_AGREEMENT = {
    "Q2_K": 0.999, "Q3_K": 0.93, "Q4_K": 0.99999, "Q5_K": 0.99999, "Q6_K": 0.999,
    "Q5_0": 0.99999, "Q5_1": 0.99999, "IQ4_NL": 0.93, "IQ4_XS": 0.94,
}  # fmt: skip

# A multilingual sample: the SentencePiece models train on it; HELD_OUT is new text.
CORPUS = """The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, i * i)
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!
Le renard brun rapide saute par-dessus le chien paresseux. Où est la gare ?
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación?
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
敏捷的棕色狐狸跳过了懒狗。你好，世界！机器学习很有趣。
素早い茶色の狐が怠け者の犬を飛び越える。こんにちは世界。
빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 안녕하세요.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.
""" * 4
HELD_OUT = [
    "Hello world, this is a held-out sentence with numbers 12345 and symbols #@!",
    "  two leading spaces and   three inside\tand a tab\nand a newline",
    "Grüße, Straße, naïve café — «quotes» and emoji 🦊🐶 that are not in the vocabulary",
    "東京は日本の首都です。Москва — столица России.",
    "class Fox:\n    def jump(self, dog):\n        return f'{self} over {dog}'",
]


@cache
def spm_model(prefix: bool) -> Path:
    """A SentencePiece BPE model with byte fallback, trained on CORPUS."""
    import tempfile

    import sentencepiece as spm

    folder = Path(tempfile.mkdtemp(prefix="spm-"))
    (folder / "corpus.txt").write_text(CORPUS)
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "m"), model_type="bpe",
        vocab_size=600, byte_fallback=True, character_coverage=0.9995,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=prefix, user_defined_symbols=["<think>"],
        control_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2,
    )  # fmt: skip
    return folder / "m.model"


def spm_vocabulary(prefix: bool) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and token types as llama.cpp's converter writes them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model(prefix)))
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        pieces.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = 1
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_byte(i):
            kind = 6
        elif pieces[-1] == "<think>":
            kind = 4
        types.append(kind)
    return pieces, scores, types


def add_spm_tokenizer(writer, prefix: bool = True, arch: str = "llama") -> int:
    pieces, scores, types = spm_vocabulary(prefix)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(pieces.index("<unk>"))
    writer.add_bos_token_id(pieces.index("<s>"))
    writer.add_eos_token_id(pieces.index("</s>"))
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(prefix)
    return len(pieces)


# -- the converted tokenizer against SentencePiece ------------------------------


@pytest.mark.parametrize("prefix", [True, False], ids=["llama-style", "gemma-style"])
def test_a_sentencepiece_vocabulary_matches_sentencepiece_token_for_token(
    tmp_path, model_cache, prefix
):
    import sentencepiece as spm

    path = tmp_path / "spm-tiny.gguf"
    writer = tiny_writer(path, "llama")
    vocab = add_spm_tokenizer(writer, prefix)
    write_model(writer, "llama", {**LLAMA, "vocab_size": vocab}, {})
    _, tokenizer, _ = load_model(str(path), "float32")
    sp = spm.SentencePieceProcessor(model_file=str(spm_model(prefix)))
    bos = sp.piece_to_id("<s>")
    for text in HELD_OUT + CORPUS.splitlines()[:10]:
        want = sp.encode(text)
        got = tokenizer.encode(text)
        assert got == [bos, *want], text
        assert tokenizer.decode(got, skip_special_tokens=True) == text, "round trip"
        assert sp.decode(want) == text
    # Byte fallback spelled the emoji, which the vocabulary lacks, as bytes.
    assert any(sp.id_to_piece(t).startswith("<0x") for t in tokenizer.encode("🦊"))
    # Control tokens are special; a user-defined one is matched whole.
    turn = tokenizer.encode("<start_of_turn>user")
    assert turn[1] == sp.piece_to_id("<start_of_turn>")
    assert sp.piece_to_id("<think>") in tokenizer.encode("a <think> b")


# -- tiny models of every architecture ------------------------------------------

LLAMA = {
    "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
    "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": 2,
    "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}  # fmt: skip
ORIGINAL_CONTEXT = 4096  # differs from the 8192 the converter assumes: same frequencies
LLAMA3 = {
    **LLAMA,
    "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
    },
}  # fmt: skip
MISTRAL = {**LLAMA, "num_key_value_heads": 1, "rope_theta": 1e6}
PHI3 = {
    "model_type": "phi3", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
    "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 16384,
    "original_max_position_embeddings": 4096, "tie_word_embeddings": False,
}  # fmt: skip
GEMMA3 = {
    "model_type": "gemma3_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
    "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": 1,
    "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 4,
    "sliding_window_pattern": 2, "max_position_embeddings": 2048,
}  # fmt: skip
QWEN3MOE = {
    "model_type": "qwen3_moe", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
    "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": 2,
    "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 256, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}  # fmt: skip
QWEN2MOE = {
    "model_type": "qwen2_moe", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
    "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
}  # fmt: skip

# mlx-lm's names -> llama.cpp's, as its converter writes them (per architecture
# where they differ).
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
_GEMMA = {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


def gguf_name(name: str, arch: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    _, _, i, *rest = stem.split(".")
    part = ".".join(rest)
    renamed = _GEMMA.get(part) if arch == "gemma3" else None
    return f"blk.{i}.{renamed or _LAYER[part]}.{suffix}"


K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
OTHER_TYPES = (Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS)
# Where a block keeps its float16 scales (byte offsets), for the types whose
# blocks are written here as random bytes (the gguf package has no quantizer
# for them): the rest of a block is any bytes.
_F16_AT = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}  # fmt: skip


def quantized(w: np.ndarray, qtype: Q, rng) -> tuple[np.ndarray, np.ndarray]:
    """(bytes for the file, the values they hold)."""
    if qtype in _F16_AT:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(w.shape[:-1]))
        raw = rng.integers(0, 256, (rows, w.shape[-1] // block, size), dtype=np.uint8)
        # Scales of the weights' own size, so the model computes sensible values.
        scale = float(np.abs(w).mean()) / (8 if qtype in (Q.Q6_K, Q.IQ4_XS) else 2)
        if qtype == Q.Q6_K:  # its 16 sub-block scales are signed bytes: keep them alike
            raw[:, :, 192:208] = rng.integers(24, 40, (rows, raw.shape[1], 16), dtype=np.uint8)
        for at in _F16_AT[qtype]:
            d = (scale * rng.uniform(0.5, 1.5, (rows, w.shape[-1] // block))).astype(np.float16)
            raw[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
        raw = raw.reshape(*w.shape[:-1], -1)
    else:
        raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape)


def tiny_writer(path: Path, arch: str):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_chat_template(
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    return writer


def write_model(writer, arch: str, config: dict, qtypes: dict, seed: int = 0) -> dict:
    """Metadata and tensors of a random mlx-lm ``config`` model, as llama.cpp
    writes them; returns the weights the file holds, in mlx-lm's layout."""
    rng = np.random.default_rng(seed)
    c = config
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c.get("max_position_embeddings", 2048))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_key_length(c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))
    writer.add_vocab_size(c["vocab_size"])
    if "num_experts" in c:
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in c:
        writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch == "gemma3":
        writer.add_sliding_window(c["sliding_window"])
        writer.add_uint32("gemma3.attention.sliding_window_pattern", c["sliding_window_pattern"])
    if arch == "phi3":
        writer.add_rope_dimension_count(HIDDEN // HEADS)
        writer.add_uint32("phi3.rope.scaling.original_context_length", 4096)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(c)
    model = model_class(args_class.from_dict(c))
    held = {}
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value, dtype=np.float32)
        if w.ndim == 1:
            w = w + 0.1 * rng.standard_normal(w.shape).astype(np.float32)
        elif name.endswith("embed_tokens.weight"):
            w = w * 0.5
        target = gguf_name(name, arch)
        stored = w
        if arch == "llama" and ".attn_q." in target:
            stored = permute(w, c["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in target:
            stored = permute(w, c["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            stored = w + 1  # llama.cpp stores Gemma's norms with their 1 added
        qtype = qtypes.get(target.rsplit(".", 1)[0], Q.F32) if w.ndim > 1 else Q.F32
        if qtype == Q.F32:
            writer.add_tensor(target, stored.astype(np.float32))
            held[name] = w
            continue
        raw, values = quantized(stored, qtype, rng)
        writer.add_tensor(target, raw, raw_dtype=qtype)
        if stored is not w and arch == "llama":  # blocks run along rows: un-permute the values
            heads = c["num_attention_heads" if ".attn_q." in target else "num_key_value_heads"]
            values = permute_back(values, heads)
        held[name] = values - 1 if arch == "gemma3" and name.endswith("norm.weight") else values
    rope = c.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_factors(c))
    if rope.get("type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    """:func:`test_gguf.permute` undone: the Q/K rows back in HF order."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs`` for Llama 3's scaling."""
    s = config["rope_scaling"]
    dims = config["head_dim"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dims, 2) / dims))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def assert_same_logits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to float32 rounding (these random models' logits reach the hundreds)."""
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-5 * float(np.abs(want).max()))


def agreement(got: np.ndarray, want: np.ndarray) -> float:
    """The median over positions of the logits' cosine similarity (a random
    model has the odd position on a knife's edge, which one flip may turn)."""
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    return float(np.median(cos))


def mixed_types(config: dict) -> dict:
    """Q4_K layers (which MLX's 4-bit groups of 32 hold almost exactly, so a
    misplaced scale or a wrong name shows), a Q8_0 embedding, a Q6_K head."""
    types = {"token_embd": Q.Q8_0, "output": Q.Q6_K}
    for i in range(config["num_hidden_layers"]):
        types |= {f"blk.{i}.{part}": Q.Q4_K for part in _LAYER.values()}
    return types


ARCHS = {
    "llama3-rope": ("llama", LLAMA3),
    "mistral-spm": ("llama", MISTRAL),
    "phi3": ("phi3", PHI3),
    "phi3-longrope": ("phi3", PHI3),
    "gemma3": ("gemma3", GEMMA3),
    "qwen2moe": ("qwen2moe", QWEN2MOE),
    "qwen3moe": ("qwen3moe", QWEN3MOE),
}


def arch_file(tmp_path: Path, case: str) -> tuple[Path, dict, dict]:
    arch, config = ARCHS[case]
    config = dict(config)
    if case == "phi3-longrope":
        rng = np.random.default_rng(3)
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": [float(x) for x in 1 + 3 * rng.random(HEAD_DIM // 2)],
            "short_factor": [float(x) for x in 1 + 0.1 * rng.random(HEAD_DIM // 2)],
        }
    path = tmp_path / f"tiny-{case}.Q4_K_M.gguf"
    writer = tiny_writer(path, arch)
    config["vocab_size"] = add_spm_tokenizer(writer, prefix=arch != "gemma3")
    held = write_model(writer, arch, config, mixed_types(config))
    return path, config, held


@pytest.mark.parametrize("case", list(ARCHS))
def test_each_architecture_converts_to_its_mlx_lm_family_with_matching_logits(
    tmp_path, model_cache, case
):
    path, config, held = arch_file(tmp_path, case)
    model, tokenizer, info = load_model(str(path), "float32")
    tokens = tokenizer.encode("The quick brown fox, der schnelle Fuchs, 敏捷的狐狸")
    assert len(tokens) > 8
    want = reference_logits(config, held, tokens)
    assert_same_logits(np.array(model(mx.array([tokens]))[0]), want)
    written = json.loads((converted(path, mode="float32") / "config.json").read_text())
    assert written["model_type"] == config["model_type"]
    if case == "gemma3":
        assert info.cache_kinds == ("RotatingKVCache", "KVCache")  # sliding, then global

    # Loaded as it is: the K-quants re-quantized to MLX's affine layout.
    quant, _, _ = load_model(str(path), None)
    q = json.loads((converted(path) / "config.json").read_text())["quantization"]
    assert {v["bits"] for k, v in q.items() if isinstance(v, dict)} <= {4, 8}
    got = np.array(quant(mx.array([tokens]))[0]).astype(np.float32)
    assert agreement(got, want) >= AGREEMENT


@pytest.mark.parametrize("qtype", K_QUANTS + OTHER_TYPES, ids=lambda q: q.name)
def test_each_quant_type_is_exact_in_float32_and_close_re_quantized(tmp_path, model_cache, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    writer = tiny_writer(path, "llama")
    config = {**LLAMA, "vocab_size": add_spm_tokenizer(writer)}
    types = {f"blk.{i}.{p}": qtype for i in range(LAYERS) for p in _LAYER.values()}
    types |= {"token_embd": qtype, "output": qtype}
    held = write_model(writer, "llama", config, types, seed=int(qtype))
    tokens = [1, *range(20, 60)]
    want = reference_logits(config, held, tokens)
    model, _, _ = load_model(str(path), "float32")
    assert_same_logits(np.array(model(mx.array([tokens]))[0]), want)

    model, _, _ = load_model(str(path), None)
    q = json.loads((converted(path) / "config.json").read_text())["quantization"]
    width = WIDTHS.get(qtype.name, {"group_size": 32, "bits": 4})
    assert q["model.layers.0.self_attn.q_proj"] == width
    got = np.array(model(mx.array([tokens]))[0]).astype(np.float32)
    assert agreement(got, want) >= TYPE_AGREEMENT[qtype.name]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_block_affine_types_keep_their_levels_in_mlx_s_layout(qtype):
    """Q4_K, Q5_K, Q5_0 and Q5_1 compute ``scale * level + offset`` per group of
    32: converted, MLX's dequantize gives the file's values back (but for the
    float16 rounding of each group's scale and offset)."""
    from mlx_nursery.actors.models.gguf_tensors import convert_tensor

    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 512)).astype(np.float32)
    raw, values = quantized(w, qtype, rng)

    class Tensor:  # what the converter reads of a GGUF reader tensor
        name, data, shape = "t.weight", raw, np.array(list(reversed(w.shape)))

    c = convert_tensor(Tensor, qtype.name, "affine")
    back = mx.dequantize(
        c.arrays["weight"], c.arrays["scales"].astype(mx.float32),
        c.arrays["biases"].astype(mx.float32), group_size=c.group_size, bits=c.bits,
    )  # fmt: skip
    assert np.abs(np.array(back) - values).max() <= 2e-3 * np.abs(values).max()


def test_q4_0_q4_1_and_q8_0_are_repacked_bit_for_bit_as_mx_load_reads_them(tmp_path):
    """The repack gives exactly the arrays ``mx.load`` makes of a file it can read
    (one of only Q4_0/Q4_1/Q8_0/F32/F16 tensors), bytes, shapes and dtypes."""
    from mlx_nursery.actors.models.gguf_tensors import convert_tensor

    path = tmp_path / "native.gguf"
    write_gguf(path)
    want = mx.load(str(path))
    for tensor in gguf.GGUFReader(path).tensors:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type).name
        got = convert_tensor(tensor, qtype, "affine").arrays
        for suffix, array in got.items():
            expected = want[f"{tensor.name.removesuffix('.weight')}.{suffix}"]
            assert array.dtype == expected.dtype and array.shape == expected.shape
            assert mx.array_equal(array, expected), (tensor.name, suffix)
