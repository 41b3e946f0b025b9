"""Build the tiny vision oracle: a Gemma 3 image-text model at toy size.

mlx-vlm's own Gemma 3 architecture (a SigLIP vision tower, the average-pooling
projector, the Gemma 3 text model) with seeded float32 weights, saved in
Hugging Face layout with the processor's files, so ``mlx_vlm.load(path)`` and
``mlx_lm.load(path)`` both open it offline. Its images are 64 x 64 pixels,
patches of 8 (an 8 x 8 grid), pooled to 16 soft tokens an image. The
tokenizer is the goldens' byte-level one with Gemma 3's three image tokens
added; its chat template is ChatML, an image part rendered as
``<start_of_image>`` (the processor widens each into the soft tokens, as
Gemma 3's does).

Run ``python goldens/make_vision_model.py`` to rebuild; the files come out
byte for byte the same each time (needs the ``vision`` extra: mlx-vlm).
``--bench`` builds the benchmark's larger one (``bench/vision.py``) into a
cache folder keyed by this builder and prints where.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from keyed import built, keyed_dir
from make_models import CONFIGS, MODELS, SPECIALS, _weights, tokenizer_config, tokenizer_json
from mlx_vlm.models.gemma3 import Model, ModelConfig
from mlx_vlm.models.gemma3.config import TextConfig, VisionConfig

HERE = Path(__file__).resolve().parent
NAME = "gemma3_vision"
IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
VOCAB = 256 + len(SPECIALS) + len(IMAGE_TOKENS)
IMAGE_TOKEN_ID = VOCAB - 1
SOFT_TOKENS = 16  # an image's soft tokens: the 8 x 8 patch grid pooled 2 x 2

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEXT = {
    key: value
    for key, value in CONFIGS["gemma3_text"].items()
    if key not in ("vocab_size", "tie_word_embeddings", "eos_token_id")
} | {"vocab_size": VOCAB, "mm_tokens_per_image": SOFT_TOKENS}
VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 8,
    "image_size": 64,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}
# The benchmark's size (bench/vision.py): a 224-pixel SigLIP of 6 layers (256
# patches pooled to 64 soft tokens) before a Gemma 3 text model of 8 layers at
# hidden 512, about 40M parameters in all; kept in a cache folder keyed by this
# builder (``keyed.py``).
BENCH_TEXT = TEXT | {
    "hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 2048,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "query_pre_attn_scalar": 64, "sliding_window": 512, "sliding_window_pattern": 6,
    "mm_tokens_per_image": 64, "max_position_embeddings": 32768,
}  # fmt: skip
BENCH_VISION = VISION | {
    "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6,
    "num_attention_heads": 6, "patch_size": 14, "image_size": 224,
}  # fmt: skip
PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor",
    "processor_class": "Gemma3Processor",
    "do_resize": True,
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "do_pan_and_scan": False,
}


def config_of(text: dict, vision: dict) -> dict:
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": VOCAB,
        "hidden_size": text["hidden_size"],
        "image_token_index": IMAGE_TOKEN_ID,
        "boi_token_index": VOCAB - 3,
        "eoi_token_index": VOCAB - 2,
        "mm_tokens_per_image": text["mm_tokens_per_image"],
        "pad_token_id": 256,  # <|endoftext|>: never in a prompt
        "eos_token_id": 258,
        "tie_word_embeddings": True,
    }


def build(path: Path, text: dict = TEXT, vision: dict = VISION) -> Path:
    full = config_of(text, vision)
    config = ModelConfig(
        text_config=TextConfig.from_dict(text),
        vision_config=VisionConfig.from_dict(vision),
        **{k: v for k, v in full.items() if k in ("model_type", "vocab_size", "hidden_size",
                                                  "image_token_index", "pad_token_id")},
    )  # fmt: skip
    model = Model(config)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    weights = _weights(model, sum(NAME.encode()) + 7)
    # mlx-vlm ties Gemma 3's head to its embeddings whatever the file holds: tied
    # here too, the embeddings scaled as Gemma's are (times sqrt(hidden) on input)
    # so that the tied logits stay in range.
    weights.pop("language_model.lm_head.weight")
    embed = "language_model.model.embed_tokens.weight"
    weights[embed] = weights[embed] / text["hidden_size"] ** 0.5
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(full, indent=1, sort_keys=True))
    tokenizer = tokenizer_json(SPECIALS + IMAGE_TOKENS)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, sort_keys=True))
    extra = dict(zip(("boi_token", "eoi_token", "image_token"), IMAGE_TOKENS, strict=True))
    settings = tokenizer_config() | {"chat_template": CHAT_TEMPLATE, "extra_special_tokens": extra}
    (path / "tokenizer_config.json").write_text(json.dumps(settings, indent=1, sort_keys=True))
    side = vision["image_size"]
    preprocessor = PREPROCESSOR | {"size": {"height": side, "width": side}}
    (path / "preprocessor_config.json").write_text(
        json.dumps(preprocessor, indent=1, sort_keys=True)
    )
    processor = {"processor_class": "Gemma3Processor",
                 "image_seq_length": text["mm_tokens_per_image"]}  # fmt: skip
    (path / "processor_config.json").write_text(json.dumps(processor, indent=1, sort_keys=True))
    return path


def bench_model() -> Path:
    """The benchmark's vision model, built once for what builds it."""
    files = [Path(__file__), HERE / "make_models.py"]
    out = keyed_dir("bench-gemma3-vision", files, [BENCH_TEXT, BENCH_VISION])
    return built(out, lambda d: build(d, BENCH_TEXT, BENCH_VISION))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODELS / NAME)
    parser.add_argument("--bench", action="store_true", help="the benchmark's size, kept keyed")
    args = parser.parse_args()
    print(bench_model() if args.bench else build(args.out))


if __name__ == "__main__":
    main()
