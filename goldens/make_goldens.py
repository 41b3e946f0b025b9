"""Record token goldens from mlx-lm itself: the oracle our engine is gated against.

This script runs mlx-lm only, never mlx-nursery code. For each tiny model in
``goldens/models`` it records greedy tokens and text:

- ``serial``: ``mlx_lm.stream_generate`` per prompt (the serial-lane oracle);
- ``batch``: ``mlx_lm.generate.BatchGenerator`` driven through scripted scenarios,
  rows inserted at chosen decode steps with their own prompt and ``max_tokens``.

Goldens are written to ``goldens/tokens/<model>.json`` with the mlx and mlx-lm
versions and the BLAS the run used. ``tests/test_goldens.py`` re-runs this oracle
live to catch drift (a new mlx, mlx-lm or BLAS) as such, not as an engine bug.
"""

from __future__ import annotations

import argparse
import json
import platform
from importlib import metadata
from pathlib import Path

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
TOKENS = HERE / "tokens"
FAMILIES = ("llama", "qwen3", "gemma3_text", "mamba2", "falcon_h1")

# Small enough that the long prompts prefill in several chunks.
PREFILL_STEP_SIZE = 32
SERIAL_MAX_TOKENS = 40

_LONG = (
    "In the beginning the engine had one lane and every agent waited its turn; "
    "then the batch arrived, and seven sub-agents decoded together while the "
    "weights streamed once for all of them, which is the whole point of it."
)
PROMPTS: dict[str, str] = {
    "short": "Hi",
    "sentence": "The quick brown fox jumps over the lazy dog.",
    "utf8": "Grüße aus Köln — 東京 🌸 naïve café",
    "long": _LONG,
}
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three prime numbers."},
]

# Scripted continuous-batching scenarios: (prompt name, insert at step, max_tokens).
# A "step" is one call of BatchGenerator.next(). Rows leave at different steps
# (different max_tokens, or EOS); "joins" inserts rows mid-decode, one of them a
# long prompt whose prefill spans several chunks; "refill" has rows join after
# another left.
SCENARIOS: dict[str, list[tuple[str, int, int]]] = {
    "static": [("short", 0, 12), ("sentence", 0, 30), ("utf8", 0, 20), ("long", 0, 25)],
    "joins": [("sentence", 0, 36), ("long", 3, 24), ("short", 8, 10), ("utf8", 8, 28)],
    # A row leaves, then others join: one into the slot it left (its prompt fits
    # the batch's width), one too long for it (the batch is compacted and extended).
    "refill": [
        ("short", 0, 4), ("sentence", 0, 30), ("utf8", 0, 26), ("short", 6, 8), ("long", 10, 12),
    ],
}


def blas_in_use() -> str:
    """Which BLAS this process has mapped: a preloaded OpenBLAS, else mlx's own."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return f"unknown ({platform.system()})"
    if "libopenblas" in maps:
        return "openblas"
    if "Accelerate" in maps:
        return "accelerate"
    return "mlx-bundled"


def environment() -> dict:
    return {
        "mlx": metadata.version("mlx"),
        "mlx_lm": metadata.version("mlx-lm"),
        "blas": blas_in_use(),
        "device": str(mx.default_device()),
    }


def prompt_ids(tokenizer, name: str) -> list[int]:
    if name == "chat":
        return list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    return list(tokenizer.encode(PROMPTS[name]))


def serial_golden(model, tokenizer, ids: list[int], max_tokens: int) -> dict:
    tokens, text, finish = [], "", None
    for response in stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, prefill_step_size=PREFILL_STEP_SIZE
    ):
        text += response.text
        finish = response.finish_reason
        tokens.append(response.token)
    if finish == "stop":
        tokens.pop()  # the EOS token itself is not part of the completion
    return {"tokens": tokens, "text": text, "finish_reason": finish}


def batch_golden(model, tokenizer, scenario: list[tuple[str, int, int]]) -> list[dict]:
    """Play one scenario through BatchGenerator; one record per row, in script order."""
    eos = sorted(tokenizer.eos_token_ids)
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in eos],
        prefill_step_size=PREFILL_STEP_SIZE,
    )
    rows: dict[int, dict] = {}
    order: list[int] = []
    step = 0
    while step <= max(at for _, at, _ in scenario) or any(
        r["finish_reason"] is None for r in rows.values()
    ):
        due = [(name, m) for name, at, m in scenario if at == step]
        if due:
            uids = gen.insert(
                [prompt_ids(tokenizer, name) for name, _ in due], max_tokens=[m for _, m in due]
            )
            for uid, (name, m) in zip(uids, due, strict=True):
                rows[uid] = {
                    "prompt": name,
                    "insert_at": step,
                    "max_tokens": m,
                    "tokens": [],
                    "finish_reason": None,
                }
                order.append(uid)
        _, generated = gen.next()
        for r in generated:
            row = rows[r.uid]
            if not (r.finish_reason == "stop" and r.token in tokenizer.eos_token_ids):
                row["tokens"].append(r.token)
            if r.finish_reason is not None:
                row["finish_reason"] = r.finish_reason
        step += 1
    gen.close()
    for row in rows.values():
        row["text"] = tokenizer.decode(row["tokens"])
    return [rows[uid] for uid in order]


def model_goldens(name: str) -> dict:
    model, tokenizer = load(str(MODELS / name))
    serial = []
    for prompt in [*PROMPTS, "chat"]:
        ids = prompt_ids(tokenizer, prompt)
        record = serial_golden(model, tokenizer, ids, SERIAL_MAX_TOKENS)
        serial.append(
            {"prompt": prompt, "prompt_ids": ids, "max_tokens": SERIAL_MAX_TOKENS, **record}
        )
    batch = {scn: batch_golden(model, tokenizer, rows) for scn, rows in SCENARIOS.items()}
    return {
        "model": name,
        "environment": environment(),
        "prefill_step_size": PREFILL_STEP_SIZE,
        "prompts": {p: prompt_ids(tokenizer, p) for p in [*PROMPTS, "chat"]},
        "serial": serial,
        "batch": batch,
    }


def write(name: str, out: Path = TOKENS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(model_goldens(name), indent=1, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(FAMILIES))
    parser.add_argument("--out", type=Path, default=TOKENS)
    args = parser.parse_args()
    for name in args.names:
        print(write(name, args.out))


if __name__ == "__main__":
    main()
