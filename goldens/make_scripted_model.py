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
from make_models import SPECIALS, VOCAB, write_tokenizer

HERE = Path(__file__).resolve().parent
CONTEXT = 262144


def build(out: Path, script: dict) -> Path:
    """A scripted model in ``out`` (replaced) answering by ``script``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_tokenizer(out, "qwen3")  # the chat template with tool markup
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["model_max_length"] = CONTEXT
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    shutil.copy(HERE / "scripted_model.py", out / "model.py")
    (out / "script.json").write_text(json.dumps(script, indent=1))
    config = {"model_type": "scripted", "model_file": "model.py", "vocab_size": VOCAB,
              "max_position_embeddings": CONTEXT, "specials": SPECIALS,
              "eos_token_id": 256 + SPECIALS.index("<|im_end|>")}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    mx.save_safetensors(str(out / "model.safetensors"), {"unit": mx.ones((1,))}, {"format": "mlx"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, required=True, help="the script (JSON)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(build(args.out, json.loads(args.script.read_text())))


if __name__ == "__main__":
    main()
