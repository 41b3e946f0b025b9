"""The reasoning split: a thinking model's text between its think markers comes
back as ``reasoning`` (OpenAI: ``reasoning_content``), the rest as content, with
the markers in neither; a prompt that opens the block starts inside it."""

from __future__ import annotations

import mlx.core as mx
from conftest import checked_engine, loaded
from mlx_nursery.actors import Event
from mlx_nursery.actors.request import FinishReason
from mlx_nursery.server.api.chat import ChatShaper, parse_chat


class ThinkingTokenizer:
    """A fake at the tokenizer boundary: the golden tokenizer, declaring the think
    markers a thinking model's tokenizer has (mlx-lm infers them from the vocab)."""

    has_thinking, think_start, think_end = True, "<think>", "</think>"

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class Script:
    """A logits processor (mlx-lm's signature) that makes the model write ``text``
    and then stop: the test scripts what a thinking model would say."""

    def __init__(self, tokenizer, prompt_len: int, text: str):
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        self.prompt_len = prompt_len

    def __call__(self, tokens, logits):
        target = self.ids[min(tokens.size - self.prompt_len, len(self.ids) - 1)]
        keep = mx.arange(logits.shape[-1]) == target
        return mx.where(keep, logits, -mx.inf)


async def generate(engine, tokenizer, prompt: list[int], text: str):
    script = Script(tokenizer, len(prompt), text)
    return await engine.generate(prompt, max_tokens=64, logits_processors=[script])


async def test_the_reasoning_is_split_out_of_the_answer():
    model, tokenizer = loaded("llama")
    thinking = ThinkingTokenizer(tokenizer)
    prompt = tokenizer.encode("Question?")
    async with checked_engine((model, thinking), batch=4) as engine:
        r = await generate(engine, tokenizer, prompt, "<think>plan: add 2 and 2</think>It is 4.")
        plain = await generate(engine, tokenizer, prompt, "No markers here.")
    assert (r.reasoning, r.text) == ("plan: add 2 and 2", "It is 4.")
    assert (plain.reasoning, plain.text) == ("", "No markers here.")


async def test_a_prompt_that_opens_the_think_block_starts_inside_it():
    model, tokenizer = loaded("llama")
    thinking = ThinkingTokenizer(tokenizer)
    prompt = tokenizer.encode("Question?\n<think>\n")
    async with checked_engine((model, thinking), batch=4) as engine:
        r = await generate(engine, tokenizer, prompt, "hmm</think>Answer.")
    assert (r.reasoning, r.text) == ("hmm", "Answer.")


def test_reasoning_goes_out_as_reasoning_content():
    parsed = parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    shaper = ChatShaper(parsed, "m", None)
    chunk = shaper.chunk(Event(5, "", reasoning="thinking"))
    assert chunk["choices"][0]["delta"] == {"reasoning_content": "thinking", "role": "assistant"}
    chunk = shaper.chunk(Event(6, "Hi", reasoning=""))
    assert chunk["choices"][0]["delta"] == {"content": "Hi"}
    end = shaper.chunk(Event(None, "", finish_reason=FinishReason.STOP))
    assert end["choices"][0]["finish_reason"] == "stop"
