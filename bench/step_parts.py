"""Where a one-row decode step's time goes on the micro model, and the limit.

A bare loop of a step's operations (no engine, no server), each step built and
started before the last one's token is read, as mlx-lm's ``generate_step``
does, against ``generate_step`` itself and the fixed-capacity probe of
``compiled_step.py``: which of the step's operations the time is in, and so how
far ahead of mlx-lm any engine doing the same work can be (docs/benchmarks.md,
"Where the time goes, and the limit"). Greedy, tok/s, one line a round.

    python bench/step_parts.py [--tokens 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from compiled_step import PROMPT, chat, fixed_decode, mlx_lm_decode, with_openblas
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

# A float32 logit spacing at the magnitude of a logprob (below 16): two logits
# closer than this may round to one logprob.
NEAR = 2.0**-18


def _step(model, cache, kind: str):
    def step(y: mx.array) -> tuple[mx.array, mx.array]:
        logits = model(y[:, None], cache=cache)[:, -1, :]
        if kind == "logprobs":  # what mlx-lm and the engine run
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(lp, -1), lp
        if kind == "apart":  # the logsumexp computed, the argmax of the logits
            return mx.argmax(logits, -1), mx.logsumexp(logits, axis=-1, keepdims=True)
        if kind == "guarded":  # no logsumexp; the first index within NEAR of the top
            top = mx.max(logits, axis=-1, keepdims=True)
            return mx.argmax(logits, -1), mx.argmax(logits >= top - NEAR, axis=-1)
        return mx.argmax(logits, -1), logits  # "argmax": no logsumexp

    return step


def bare(model, prompt: mx.array, n: int, kind: str) -> float:
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], -1)
    step = _step(model, cache, kind)
    nxt = step(y)
    mx.async_eval(nxt)
    start = time.perf_counter()
    for _ in range(n):
        after = step(nxt[0])
        mx.async_eval(after)
        nxt[0].item()
        nxt = after
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with_openblas(__file__)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "goldens"))
    from make_micro_model import ensure

    model, tokenizer = load(str(ensure()))
    prompt = mx.array(chat(tokenizer, PROMPT))
    for r in range(args.rounds):
        rates = {k: bare(model, prompt, args.tokens, k)
                 for k in ("logprobs", "apart", "argmax", "guarded")}  # fmt: skip
        rates["generate_step"] = mlx_lm_decode(model, prompt, args.tokens)[1]
        rates["fixed"] = fixed_decode(model, prompt, args.tokens, False)[1]
        rates["fixed, compiled"] = fixed_decode(model, prompt, args.tokens, True)[1]
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()), flush=True)


if __name__ == "__main__":
    main()
