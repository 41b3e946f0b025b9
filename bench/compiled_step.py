"""Issue 47's table on whatever backend mlx runs on (CPU, CUDA, Metal): the
engine's decode with its compiled blocks on and off against mlx-lm, at B = 1, 4
and 8, and a whole forward under ``mx.compile`` at a fixed KV capacity.

For each model and dtype, in one process:

- B = 1: mlx-lm's ``generate_step`` (what ``mlx_lm.generate`` runs), greedy,
  timed from its first token; the engine's ``generate`` with ``--compile off``
  and ``on`` (its decode tok/s), their tokens checked equal to mlx-lm's;
- B = 1, the probe: a fixed-capacity KV written at an array offset, the forward
  plain and under ``mx.compile`` (tokens checked equal to mlx-lm's);
- B = 4 and 8: mlx-lm's ``BatchGenerator`` against the engine (off, on): the
  aggregate tok/s of that many short prompts decoded together, start to end.

Every side stops at the model's end token (the same greedy tokens on every
side, so the same work); the engine runs with speculation off (the step is what
is measured) and no prompt cache. Sides take turns over ``--rounds``, after
``--warmup`` untimed rounds (mlx builds kernels on first use: on CUDA, inside
whichever side runs a shape first); the medians are shown. The engine's B = 1
step is also split into its GPU call and the rest (the event loop's turn
between calls; the wall time a step takes counts the prompt's prefill too).

``--extras``: the engine at B = 8 with 8-bit and 4-bit KV against float KV,
and one prompt's 4 sampled choices at once (forked from one prefill) against
the same 4 requests one after another.

``--random DIR`` takes a model's ``config.json`` and tokenizer from DIR and
draws seeded weights for it (``goldens/make_models.py``'s), so a machine that
cannot hold or reach the weights (the lent GPU: 64 MiB travel there) still runs
the model's shapes and kernels: a step's speed does not depend on the values.

    python bench/compiled_step.py --model LABEL=DIR [--random LABEL=DIR] [--real] \
        [--dtype bfloat16] [--tokens 256] [--rounds 2] [--extras] [--out FILE.md] \
        [--section NAME] [--openblas]

``--real`` adds SmolLM2-135M-Instruct (the default model, dequantized to
float32); ``--section`` writes the table into docs/benchmarks.md;
``--openblas`` re-runs the script with OpenBLAS preloaded (``make bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

CAPACITY = 1024
PROMPT = "Write a short story about a robot who learns to paint."
QUESTIONS = [
    "Explain how a heat pump works.",
    "What makes a good unit test?",
    "Describe the water cycle to a child.",
    "Why do cats purr?",
    "How does a compiler turn code into machine instructions?",
    "Give three tips for writing clear documentation.",
    "What is the difference between a process and a thread?",
    "Summarise the plot of a heist film you would like to see.",
]


class FixedKV:
    """One layer's KV at a fixed capacity: written at an array offset, read whole,
    the positions past the offset masked (so the traced graph repeats)."""

    def __init__(self, keys, values) -> None:
        self.keys, self.values = keys, values
        self.offset = self.start = None  # set each step, as arrays

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        self.keys = mx.slice_update(self.keys, keys, self.start, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        import mlx.core as mx

        return mx.arange(self.keys.shape[2])[None] <= (self.offset + mx.arange(n))[:, None]


def mlx_lm_decode(model, prompt, n: int, stop=()) -> tuple[list[int], float]:
    """mlx-lm's ``generate_step``, greedy, up to ``n`` tokens or a ``stop`` token
    (kept, as ``mlx_lm.generate`` stops): the tokens and the tok/s after the first."""
    from mlx_lm.generate import generate_step

    out, start = [], 0.0
    for token, _ in generate_step(prompt, model, max_tokens=n):
        out.append(int(token))
        if len(out) == 1:
            start = time.perf_counter()
        if out[-1] in stop:
            break
    return out, (len(out) - 1) / (time.perf_counter() - start)


def fixed_decode(model, prompt, n: int, compiled: bool) -> tuple[list[int], float, float]:
    """Greedy decode on a fixed-capacity KV, the forward plain or under
    ``mx.compile``: tokens, tok/s after the first call, the first call's seconds."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    solo = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=solo)[:, -1], -1)
    caches, kv, used = [], [], prompt.size
    for c in solo:
        b, h, _, d = c.keys.shape
        keys = mx.zeros((b, h, CAPACITY, d), c.keys.dtype)
        values = mx.zeros((b, h, CAPACITY, d), c.values.dtype)
        keys[..., :used, :] = c.keys[..., :used, :]
        values[..., :used, :] = c.values[..., :used, :]
        caches.append(FixedKV(keys, values))
        kv += [keys, values]
    mx.eval(kv, y)

    def forward(tokens, offset, *kv):
        for i, c in enumerate(caches):
            c.keys, c.values, c.offset, c.start = kv[2 * i], kv[2 * i + 1], offset, offset[None]
        token = mx.argmax(model(tokens, cache=caches)[:, -1], -1)
        return (token, *[a for c in caches for a in (c.keys, c.values)])

    step = mx.compile(forward) if compiled else forward
    offset = mx.array(used)
    start = time.perf_counter()
    nxt, *kv = step(y[:, None], offset, *kv)
    mx.eval(nxt, kv)
    first = time.perf_counter() - start
    out = [y.item()]
    y, offset = nxt, offset + 1
    start = time.perf_counter()
    for _ in range(n - 1):
        nxt, *kv = step(y[:, None], offset, *kv)
        mx.async_eval(nxt, kv)
        out.append(y.item())
        y, offset = nxt, offset + 1
    return out, (n - 1) / (time.perf_counter() - start), first


def chat(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def mlx_batch(model, prompts: list[list[int]], n: int, stop) -> float:
    """mlx-lm's ``BatchGenerator``: aggregate tok/s, start to end."""
    from mlx_lm.generate import BatchGenerator

    start = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[[t] for t in stop])
    gen.insert(prompts, max_tokens=[n] * len(prompts))
    tokens = 0
    while responses := gen.next_generated():
        tokens += len(responses)
    gen.close()
    return tokens / (time.perf_counter() - start)


# The engine's sides: --compile off and on (--packed-weights off), and the
# defaults (both on).
SIDES = ("off", "on", "packed")


def engine_run(
    model, tokenizer, prompts, n: int, compile: str, dtype, together: bool = True,
    params=None, **options,
) -> dict:  # fmt: skip
    """The engine (``--compile`` as given, or ``packed``: compile on with
    ``--packed-weights``, the defaults; speculation off, ``options`` as settings)
    on ``prompts`` at once (``together``) or one after another:
    aggregate tok/s start to end, one row's decode tok/s, the tokens, the
    seconds ``open_engine`` took (its load and probe forward: where the compiled
    blocks' kernels are built), and the mean ms of a decode step's GPU call
    against the wall time a step took (the rest is the event loop's)."""
    params = params or (lambda i: {"temperature": 0.0})
    options.setdefault("packed_weights", compile == "packed")
    compile = "on" if compile == "packed" else compile
    import trio
    from mlx_nursery.actors import open_engine

    async def go():
        t0 = time.perf_counter()
        async with open_engine(
            (model, tokenizer), batch=8, speculative=False, prompt_cache_size=0,
            compile=compile, dtype=dtype, **options,
        ) as engine:  # fmt: skip
            opened = time.perf_counter() - t0
            results = [None] * len(prompts)

            async def one(i):
                results[i] = await engine.generate(prompts[i], max_tokens=n, **params(i))

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    if together:
                        nursery.start_soon(one, i)
                    else:
                        await one(i)
            wall = time.perf_counter() - start
            stats = engine.stats()
            compiled = stats.compiled
        return {
            "gpu_ms": 1000 * stats.step_time.sum / max(stats.step_time.count, 1),
            "wall_ms": 1000 * wall / max(stats.step_time.count, 1),
            "rate": sum(len(r.tokens) for r in results) / wall,
            "row_rate": results[0].usage.decode_tokens_per_second,
            "tokens": list(results[0].tokens),
            "opened": opened,
            "share": compiled.share if compiled else 0.0,
        }

    try:
        return trio.run(go)
    finally:
        # The engine swaps classes on the model it is given: mlx-lm's own runs on
        # the same model object must find mlx-lm's modules again.
        from mlx_nursery.actors.kernels import fused, packed

        fused.uninstall(model)
        packed.uninstall(model)


def random_model(config_dir: Path, dtype: str, seed: int = 47) -> Path:
    """A model folder with ``config_dir``'s config and tokenizer and seeded
    weights in ``dtype``, in a temporary folder."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "goldens"))
    from make_models import _weights

    out = Path(tempfile.mkdtemp(prefix="compiled-step-"))
    for f in config_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",):
            shutil.copy(f, out / f.name)
    config = json.loads((config_dir / "config.json").read_text())
    config.pop("quantization", None)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in _weights(model, seed).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def load_as(folder: Path, dtype: str) -> tuple:
    """The model (cast to ``dtype``, evaluated) and its tokenizer."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(folder))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, tokenizer


def medians(runs: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """Each side's median over the timed rounds (the first ``warmup`` dropped)."""
    return {k: statistics.median(v[warmup:]) for k, v in runs.items()}


def measure(model, tokenizer, label: str, dtype: str, n: int, rounds: int,
            warmup: int) -> list[dict]:  # fmt: skip
    """The B = 1 row and the B = 4 and 8 rows of the table. The first ``warmup``
    rounds are not timed: kernels built on first use (mlx's CUDA JIT) are no
    side's cost."""
    import mlx.core as mx

    stop = set(tokenizer.eos_token_ids)
    prompt = chat(tokenizer, PROMPT)
    one = {"mlx": [], "off": [], "on": [], "packed": [], "fixed": [], "fixed_c": []}
    equal = {"off": True, "on": True, "packed": True, "fixed": True, "fixed_c": True}
    opened = {"off": [], "on": [], "packed": []}
    split = []  # (GPU call ms, wall ms) a step, compile off
    for _ in range(warmup + rounds):
        want, rate = mlx_lm_decode(model, mx.array(prompt), n, stop)
        one["mlx"].append(rate)
        for side in SIDES:
            r = engine_run(model, tokenizer, [prompt], n, side, dtype)
            one[side].append(r["row_rate"])
            opened[side].append(r["opened"])
            if side == "off":
                split.append((r["gpu_ms"], r["wall_ms"]))
            equal[side] &= r["tokens"] == want
        for side, compiled in (("fixed", False), ("fixed_c", True)):
            got, rate, _ = fixed_decode(model, mx.array(prompt), len(want), compiled)
            one[side].append(rate)
            equal[side] &= got == want
    rows = [{"label": label, "dtype": dtype, "B": 1, **medians(one, warmup), "equal": equal,
             "n": len(want), "opened": {k: min(v[warmup:]) for k, v in opened.items()},
             "split": min(split[warmup:], key=lambda x: x[1])}]  # fmt: skip
    for b in (4, 8):
        prompts = [chat(tokenizer, q) for q in QUESTIONS[:b]]
        agg = {"mlx": [], "off": [], "on": [], "packed": []}
        for _ in range(warmup + rounds):
            agg["mlx"].append(mlx_batch(model, prompts, n, stop))
            for side in SIDES:
                agg[side].append(engine_run(model, tokenizer, prompts, n, side, dtype)["rate"])
        rows.append({"label": label, "dtype": dtype, "B": b, **medians(agg, warmup)})
        print(rows[-1], flush=True)
    print(rows[0], flush=True)
    return rows


def extras(model, tokenizer, label: str, dtype: str, n: int, rounds: int, warmup: int) -> dict:
    """Issue 45's rows on this backend: 8 rows with float, 8-bit and 4-bit KV
    (aggregate tok/s), and one prompt's 4 sampled choices decoded together (the
    engine forks them from one prefill) against the same 4 one after another."""
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    runs = {"float": [], "8": [], "4": [], "together": [], "apart": []}
    for _ in range(warmup + rounds):
        for bits in ("float", "8", "4"):
            kv = {} if bits == "float" else {"kv_bits": int(bits)}
            try:
                r = engine_run(model, tokenizer, prompts, n, "packed", dtype, **kv)
                runs[bits].append(r["rate"])
            except Exception as exc:  # refused where mlx cannot run quantized attention
                print(f"{bits} KV failed: {exc!r}"[:400], flush=True)
                runs[bits].append(float("nan"))
        same = [chat(tokenizer, PROMPT)] * 4
        for side, together in (("together", True), ("apart", False)):
            r = engine_run(model, tokenizer, same, n, "packed", dtype, together,
                           params=lambda i: {"temperature": 1.0, "seed": 7 + i})  # fmt: skip
            runs[side].append(r["rate"])
    out = {"label": label, "dtype": dtype, **medians(runs, warmup)}
    print(out, flush=True)
    return out


def extras_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "The engine (the defaults: compile and packed weights on; speculation off) with "
        "quantized KV at B = 8, and one "
        "prompt's 4 sampled choices at once (forked from one prefill) against the same 4 "
        "requests one after another (tok/s):",
        "",
        "| model | dtype | float KV | 8-bit KV | 4-bit KV | 4 choices at once | 4 one by one "
        "| ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['dtype']} | {r['float']:.1f} | {r['8']:.1f} "
            f"({r['8'] / r['float']:.2f}x) | {r['4']:.1f} ({r['4'] / r['float']:.2f}x) | "
            f"{r['together']:.1f} | {r['apart']:.1f} | {r['together'] / r['apart']:.2f}x |"
        )
    return lines


def table(rows: list[dict], n: int, rounds: int, backend: str) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d')}; {backend}; greedy, up to {n} tokens a row (or "
        f"the end token), medians of {rounds} rounds after an untimed one; the engine with "
        "speculation off and no prompt cache. B=1: decode tok/s after the first token (the "
        "row's token count in brackets); B=4 and 8: aggregate tok/s, start to end, against "
        "`BatchGenerator`. Tokens equal: the B=1 tokens against `generate_step`'s.",
        "",
        "| model | dtype | B | mlx-lm | engine, compile off | engine, compile on "
        "| engine, compile on + packed weights (defaults) | defaults / mlx-lm | on / off "
        "| packed / on | fixed-capacity forward, plain / `mx.compile` | tokens equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        probe, same = "-", "-"
        if r["B"] == 1:
            probe = f"{r['fixed']:.1f} / {r['fixed_c']:.1f} ({r['fixed_c'] / r['mlx']:.2f}x)"
            same = ", ".join(f"{k} {v}" for k, v in r["equal"].items())
        b = f"1 ({r['n']})" if r["B"] == 1 else str(r["B"])
        lines.append(
            f"| {r['label']} | {r['dtype']} | {b} | {r['mlx']:.1f} | {r['off']:.1f} | "
            f"{r['on']:.1f} | {r['packed']:.1f} | {r['packed'] / r['mlx']:.2f}x | "
            f"{r['on'] / r['off']:.2f}x | {r['packed'] / r['on']:.2f}x | {probe} | {same} |"
        )
    opened = [r for r in rows if "opened" in r]
    lines += ["", "Where the engine's B = 1 step goes (compile off): its GPU call, of the "
              "wall time a step took (the rest runs on the event loop between calls): " +
              "; ".join(f"{r['label']} {r['dtype']}: {r['split'][0]:.2f} of "
                        f"{r['split'][1]:.2f} ms" for r in opened)]  # fmt: skip
    lines += ["", "Engine open (load, probe forward; the compiled blocks' kernels are built "
              "here; with packed weights, the checks and the packing too), fastest of the "
              "rounds: " + "; ".join(
                  f"{r['label']} {r['dtype']}: off {r['opened']['off']:.2f} s, on "
                  f"{r['opened']['on']:.2f} s, packed {r['opened']['packed']:.2f} s"
                  for r in opened)]  # fmt: skip
    return "\n".join(lines)


def with_openblas(script: str) -> None:
    """Re-run ``script`` (this process's own) with OpenBLAS preloaded, where it is
    installed and not preloaded yet (``mlx-nursery serve`` does the same)."""
    from mlx_nursery.server.blas import find_openblas

    lib = find_openblas()
    if lib and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        argv = [sys.executable, str(Path(script).resolve()), *sys.argv[1:]]
        os.execve(sys.executable, argv, dict(os.environ, LD_PRELOAD=lib))


def backend() -> str:
    import mlx.core as mx

    device = mx.default_device()
    if device.type == mx.DeviceType.cpu:
        maps = Path("/proc/self/maps")
        blas = "OpenBLAS (preloaded)" if maps.exists() and "libopenblas" in maps.read_text() else (
            "mlx's bundled BLAS")  # fmt: skip
        return f"mlx {mx.__version__} on the CPU, {blas}"
    try:
        name = mx.device_info().get("device_name", device)
    except Exception:  # an mlx without device_info, or a backend that has none
        name = device
    return f"mlx {mx.__version__} on {name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[], help="LABEL=DIR")
    parser.add_argument("--random", action="append", default=[], help="LABEL=DIR (config)")
    parser.add_argument("--dtype", action="append", default=[])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--extras", action="store_true", help="quantized KV, 4 choices")
    parser.add_argument("--no-table", action="store_true", help="the extras alone")
    parser.add_argument("--real", action="store_true", help="add SmolLM2 (float32)")
    parser.add_argument("--section", help="write into docs/benchmarks.md's section")
    parser.add_argument("--openblas", action="store_true", help="re-run with OpenBLAS")
    args = parser.parse_args()
    if args.openblas:
        with_openblas(__file__)
    if args.real:
        from benchsuite import float32_copy
        from mlx_nursery.actors.models import registry

        smol = float32_copy(registry.fetch(registry.DEFAULT))
        args.model.insert(0, f"SmolLM2-135M-Instruct={smol}")
    rows, more = [], []
    for dtype in args.dtype or ["float32"]:
        for spec, random in [(m, False) for m in args.model] + [(m, True) for m in args.random]:
            label, _, folder = spec.partition("=")
            folder = random_model(Path(folder), dtype) if random else Path(folder)
            label += " (seeded weights)" if random else ""
            model, tokenizer = load_as(folder, dtype)
            timing = (label, dtype, args.tokens, args.rounds, args.warmup)
            if not args.no_table:
                rows += measure(model, tokenizer, *timing)
            if args.extras or args.no_table:
                more.append(extras(model, tokenizer, *timing))
            if random:
                shutil.rmtree(folder, ignore_errors=True)
    body = table(rows, args.tokens, args.rounds, backend()) if rows else backend()
    if more:
        body += "\n".join(["", *extras_table(more)])
    print(body, flush=True)
    if args.out:
        args.out.write_text(body + "\n")
    if args.section:
        from benchsuite import _write_section

        _write_section(args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
