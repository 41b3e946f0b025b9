"""mlx-lm's own tensor-parallel generation, the oracle for the sharded engine.

Run under ``mlx.launch`` with the same rank count as the engine under test:
``reference.py MODEL PROMPTS.json OUT.json``. Every rank loads its shard with
mlx-lm's ``sharded_load`` and runs ``stream_generate`` (greedy) on each prompt
(a list of token ids, with its max_tokens); rank 0 writes the tokens.
"""

import json
import sys

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import sharded_load


def main() -> None:
    model_path, prompts_file, out_file = sys.argv[1:4]
    group = mx.distributed.init(backend="ring", strict=True)
    model, tokenizer = sharded_load(model_path, tensor_group=group)
    model.set_dtype(mx.float32)  # as the engine's dtype "auto" does on a CPU
    mx.eval(model.parameters())
    out = []
    for prompt in json.loads(open(prompts_file).read()):
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
        with open(out_file, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
