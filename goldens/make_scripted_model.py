"""Build a scripted test model (goldens/scripted_model.py): a directory mlx-lm
loads with ``trust_remote_code`` whose answers follow a script keyed by the
conversation, written in the served tool format (Qwen/Hermes ``<tool_call>``
JSON, parsed by mlx-lm's json_tools). Real clients then run real agent loops
against it: read a file, edit it, start sub-agents, answer.

Its tokenizer is the golden models' (goldens/make_models.py: byte-level with no
merges, a token is a byte, the chatml specials follow; qwen3's template with its
tool markup), so the model reads the conversation back from the ids alone. Its
context is 262,144 tokens: a coding agent's prompt (Claude Code's is ~80 kB) in
bytes, with room for the turns after it. Building takes no training and no
network: a directory per script is cheap.

    python goldens/make_scripted_model.py --script script.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from family_fixtures import FIXTURES
from family_fixtures import write_tokenizer as write_family_tokenizer
from make_models import (
    CONFIGS,
    MODELS,
    ONE_LAYER,
    SPECIALS,
    TOOL_CHAT_TEMPLATE,
    _weights,
    write_tokenizer,
)
from mlx.utils import tree_flatten
from mlx_lm.models import llama

HERE = Path(__file__).resolve().parent
CONTEXT = 262144


# A transformer body that costs what a tiny llama's forward does.
BODY = {**ONE_LAYER, "max_position_embeddings": CONTEXT, "tie_word_embeddings": True}


def _tokenizer(out: Path, family: str | None) -> tuple[list, list, str]:
    """The tokenizer files: the golden chatml one (qwen3's template with its tool
    markup), or a family's (its real template and specials); (specials, end
    tokens, dialect)."""
    if family is None:
        write_tokenizer(out, "qwen3")
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["model_max_length"] = CONTEXT
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        return SPECIALS, ["<|im_end|>"], "chatml"
    fixture = write_family_tokenizer(out, family)
    return list(fixture.specials), list(fixture.eos), fixture.dialect


def build(out: Path, script: dict, body: dict | None = None, family: str | None = None,
          vision: bool = False) -> Path:  # fmt: skip
    """A scripted model in ``out`` (replaced) answering by ``script``; with
    ``body`` (a llama config, e.g. ``BODY``), a random transformer runs beside the
    script, so its forward costs what that model's does. ``family``: one of
    ``family_fixtures.FIXTURES``, whose template it is served with and whose
    markup it writes (default: chatml with Hermes calls). ``vision``: a Gemma 3
    vision checkpoint as well (the tiny one's weights and processor, from
    ``make_vision_model``), so the engine serves it with images; the script reads
    an image as ``[image]``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    specials, ends, dialect = _vision_tokenizer(out) if vision else _tokenizer(out, family)
    vocab = 256 + len(specials)
    shutil.copy(HERE / "scripted_model.py", out / "model.py")
    (out / "script.json").write_text(json.dumps(script, indent=1))
    config = {"model_type": "scripted", "model_file": "model.py", "vocab_size": vocab,
              "max_position_embeddings": CONTEXT, "specials": specials, "dialect": dialect,
              "eos_token_id": [256 + specials.index(e) for e in ends], "body": body}  # fmt: skip
    weights = {"unit": mx.ones((1,))}
    if vision:
        config = _vision_config(out, config)
        weights = {}
    if body is not None:
        mx.random.seed(0)
        model = llama.LlamaModel(llama.ModelArgs.from_dict({"vocab_size": vocab, **body}))
        weights |= {f"body.{k}": v for k, v in tree_flatten(model.parameters())}
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    if weights:
        mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    return out


def _vision_tokenizer(out: Path) -> tuple[list, list, str]:
    """The tiny vision model's tokenizer (the golden one with Gemma 3's image
    tokens) with a template that writes tools as qwen3's and content parts as
    the vision model's (an image in a tool result too)."""
    from make_vision_model import IMAGE_TOKENS, NAME

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODELS / NAME / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config |= {"model_max_length": CONTEXT, "chat_template": _with_parts(TOOL_CHAT_TEMPLATE)}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return SPECIALS + IMAGE_TOKENS, ["<|im_end|>"], "chatml"


def _with_parts(template: str) -> str:
    """``template`` with each ``message.content`` written part by part where it is
    a list (text as itself, an image as ``<start_of_image>``)."""
    parts = (
        "{%- macro content(c) -%}{%- if c is string -%}{{ c }}{%- else -%}"
        "{%- for item in c -%}{%- if item.type == 'image' -%}{{ '<start_of_image>' }}"
        "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}"
        "{%- endif -%}{%- endmacro -%}"
    )
    return parts + template.replace("{{ message.content }}", "{{ content(message.content) }}")


def _vision_config(out: Path, config: dict) -> dict:
    """The tiny vision model's config, weights and processor files beside the
    script's: the engine loads its image side from them, the script's model keeps
    only the embedding table (``scripted_model.Model.sanitize``)."""
    from make_vision_model import NAME

    source = MODELS / NAME
    for name in ("model.safetensors", "preprocessor_config.json", "processor_config.json"):
        shutil.copy(source / name, out / name)
    vision = json.loads((source / "config.json").read_text())
    embeds = vision["text_config"]["hidden_size"]
    return {**vision, **config, "model_type": "gemma3", "embeds": embeds}


def build_noise(out: Path, family: str) -> Path:
    """A random-weight tiny llama served with a family's tokenizer and template:
    its free text is noise, so only a constraint makes it call a tool."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    specials, ends, _ = _tokenizer(out, family)
    config = {**CONFIGS["llama"], "vocab_size": 256 + len(specials),
              "max_position_embeddings": CONTEXT,
              "eos_token_id": [256 + specials.index(e) for e in ends]}  # fmt: skip
    model = llama.Model(llama.ModelArgs.from_dict(config))
    seed = sum(family.encode())
    mx.save_safetensors(str(out / "model.safetensors"), _weights(model, seed), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, required=True, help="the script (JSON)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--body", action="store_true", help="a tiny llama's cost (BODY)")
    parser.add_argument("--family", choices=sorted(FIXTURES), help="a tool-call family's template")
    args = parser.parse_args()
    script = json.loads(args.script.read_text())
    print(build(args.out, script, BODY if args.body else None, args.family))


if __name__ == "__main__":
    main()
