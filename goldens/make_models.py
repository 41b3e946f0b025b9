"""Build the tiny oracle models: deterministic float32 checkpoints, one per cache kind.

Each model is a real mlx-lm architecture at toy size with seeded weights, saved
in Hugging Face layout so ``mlx_lm.load(path)`` opens it offline. All share one
byte-level tokenizer (256 byte tokens plus specials, a ChatML template, an EOS).

Run ``python goldens/make_models.py`` to rebuild; the files come out byte for byte
the same each time (numpy's seeded generator, sorted keys everywhere).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
# The engine package's embedded default model (`mlx-nursery serve` with no --model): the
# llama toy, shipped inside the package so `make serve` works offline.
DEFAULT_MODEL = HERE.parent / "actors" / "models" / "default_model"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"
VOCAB = 256 + len(SPECIALS)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# qwen3's template carries tool markup of its own, Qwen/Hermes style (mlx-lm reads
# it as json_tools): the native tool path is tested without a download. Without
# tools it renders exactly as CHAT_TEMPLATE does, so the chat goldens are the same.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall a function as <tool_call>\n"
    '{"name": <name>, "arguments": <json>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {"qwen3": TOOL_CHAT_TEMPLATE}

_COMMON = {"vocab_size": VOCAB, "tie_word_embeddings": True, "eos_token_id": 258}

# One llama layer of one head, hidden 64: the body of the scripted, client and micro
# models, a forward that costs almost nothing (on a CPU, attention over a long
# prompt is most of it: a score matrix per head and layer).
ONE_LAYER = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
             "intermediate_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0}  # fmt: skip

# Sizes keep each file well under 1 MB. The weight scale in `_weights` (3/sqrt(fan_in))
# makes logits peaked, so greedy decoding sits far from argmax ties, and keeps the
# random models from collapsing into one repeated token (1.5 did, for qwen3 and mamba2).
CONFIGS: dict[str, dict] = {
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
    },
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 4096,
    },
    "mamba2": {
        **_COMMON,
        "model_type": "mamba2",
        "num_heads": 8,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": "auto",
        "max_position_embeddings": 4096,
    },
    "falcon_h1": {
        **_COMMON,
        "model_type": "falcon_h1",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 128,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 8,
        "mamba_chunk_size": 32,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    },
}


# Variants with 64-wide attention heads: mlx quantizes KV in groups of 32 or more
# along a head (``--kv-bits``), so the 16-wide toys cannot take it. The same
# models otherwise; the head-16 goldens stay as they are.
HEAD_64 = ("llama", "qwen3", "gemma3_text", "falcon_h1")
for _name in HEAD_64:
    CONFIGS[f"{_name}_h64"] = {**CONFIGS[_name], "head_dim": 64}
CONFIGS["gemma3_text_h64"] |= {"query_pre_attn_scalar": 64, "num_attention_heads": 2,
                                "num_key_value_heads": 1}  # under 1 MB


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json(specials: list[str] = SPECIALS) -> dict:
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode())}
    added = [
        {
            "id": 256 + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(specials)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config(name: str = "llama") -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATES.get(name, CHAT_TEMPLATE),
    }


def _weights(model, seed: int) -> dict[str, mx.array]:
    """Seeded normal weights; norms at one, so every layer stays well scaled."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in sorted(tree_flatten(model.parameters())):
        shape = value.shape
        if "norm" in name and len(shape) == 1:
            arr = np.ones(shape, np.float32)
        elif name.endswith("A_log"):
            arr = np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        elif name.endswith(".D") or name.endswith("dt_bias"):
            arr = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif len(shape) == 1:
            arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = int(np.prod(shape[1:]))
            scale = 1.0 if "embed" in name else 3.0 / np.sqrt(fan_in)
            arr = (scale * rng.standard_normal(shape)).astype(np.float32)
        out[name] = mx.array(arr)
    return out


def write_tokenizer(path: Path, name: str = "llama") -> None:
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(), indent=1, sort_keys=True))
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(name), indent=1, sort_keys=True)
    )


def build(name: str, out_root: Path = MODELS, path: Path | None = None) -> Path:
    config = CONFIGS[name]
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    path = path or out_root / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    seed = sum(name.encode()) + 7
    mx.save_safetensors(str(path / "model.safetensors"), _weights(model, seed), {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    write_tokenizer(path, name)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=sorted(CONFIGS), help="models to build")
    parser.add_argument("--out", type=Path, default=MODELS)
    args = parser.parse_args()
    for name in args.names:
        print(build(name, args.out))
    if args.out == MODELS:
        print(build("llama", path=DEFAULT_MODEL))


if __name__ == "__main__":
    main()
