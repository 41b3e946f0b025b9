"""mlx-lm's own tensor-parallel generation, the oracle for the sharded engine.

Run under ``mlx.launch`` with the same rank count as the engine under test:
``reference.py MODEL PROMPTS.json OUT.json``. Every rank loads its shard with
mlx-lm's ``sharded_load`` and runs ``stream_generate`` (greedy) on each prompt
(a list of token ids, with its max_tokens); rank 0 writes the tokens.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import sharded_load
from mlx_nursery.actors.models.load import cast


def main() -> None:
    model_path, prompts_file, out_file = sys.argv[1:4]
    group = mx.distributed.init(backend="ring", strict=True)
    model, tokenizer = sharded_load(model_path, tensor_group=group)
    cast(model, "auto")  # the engine's dtype: float32 on a CPU (dequantized shards)
    out = []
    for prompt in json.loads(Path(prompts_file).read_text()):
        tokens = [
            r.token
            for r in stream_generate(
                model,
                tokenizer,
                mx.array(prompt["ids"]),
                max_tokens=prompt["max_tokens"],
                sampler=make_sampler(0.0),
            )
        ]
        # stream_generate stops at EOS and yields it; the engine never shows EOS
        out.append([t for t in tokens if t not in tokenizer.eos_token_ids])
    if group.rank() == 0:
        Path(out_file).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
