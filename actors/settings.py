"""The engine's settings: one frozen record, checked once, passed whole.

Each setting is declared once, with :func:`setting`: its name, default, check
and help text. The CLI builds its flags from these declarations, ``open_engine``
takes them as keywords, and every actor reads them from here. A bad value
raises :class:`InvalidRequest` naming the setting and what to change. The
request defaults (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``) are settings too: the intake fills them into every request that
does not give its own, whichever API it came through.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .budget import parse_budget, parse_bytes
from .errors import InvalidRequest
from .request import DEFAULT_MAX_TOKENS, SamplingParams
from .speculation.drafters import MAX_DRAFT
from .step.quantized import BITS, DEFAULT_QUANTIZED_KV_START, GROUP_SIZES, KvBits

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUEUE_PER_SLOT = 8  # the default queue bound: this many waiting rows per batch slot


def setting(
    default: Any = attrs.NOTHING,
    *,
    help: str,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    shown: str | None = None,
    cli: bool = True,
    **field: Any,
) -> Any:
    """An attrs field that declares a setting: ``help`` (the CLI's text, without
    the default, which is added from ``default`` or ``shown``), ``flag`` (the
    CLI's name where it is not the field's, dashed) and its ``aliases``,
    ``parse`` (the CLI's conversion of the text; by default from the default's
    type), ``cli`` False for settings no flag sets."""
    metadata = {"help": help, "flag": flag, "aliases": aliases, "parse": parse,
                "shown": shown, "cli": cli}  # fmt: skip
    return attrs.field(default=default, metadata=metadata, **field)


def _seconds(*, optional: bool = False):
    def check(_, attribute, value) -> None:
        if value is None and optional:
            return
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if not ok or value != value or value == float("inf"):
            raise InvalidRequest(
                f"{attribute.name} must be a positive number of seconds, got {value!r}",
                param=attribute.name,
            )

    return check


def _at_least(n: int, *, optional: bool = False):
    def check(_, attribute, value) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < n:
            raise InvalidRequest(
                f"{attribute.name} must be an integer of at least {n}, got {value!r}",
                param=attribute.name,
            )

    return check


def _off_or_float(text: str) -> float | None:
    return None if text.strip().lower() in ("off", "none") else float(text)


def _on_off(text: str) -> bool:
    word = text.strip().lower()
    if word not in ("on", "off", "true", "false"):
        raise ValueError(f"expected on or off, got {text!r}")
    return word in ("on", "true")


def _depth(text: str) -> int:
    """``off``, ``on`` (1) or a number of steps."""
    word = text.strip().lower()
    if word in ("on", "off", "true", "false"):
        return int(_on_off(word))
    try:
        return int(word)
    except ValueError:
        raise ValueError(f"expected on, off or a number of steps, got {text!r}") from None


def _steps(value: Any) -> Any:
    """True and False as 1 and 0 steps (the setting was on or off)."""
    return int(value) if isinstance(value, bool) else value


def _boolean(_, attribute, value) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(
            f"{attribute.name} must be true or false (on or off), got {value!r}",
            param=attribute.name,
        )


def _dtype(_, attribute, value) -> None:
    if value is not None and value not in DTYPES:
        raise InvalidRequest(
            f"dtype must be one of {', '.join(DTYPES)}, got {value!r}", param="dtype"
        )


def _one_of(choices: tuple[int, ...], *, optional: bool = False):
    def check(_, attribute, value) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or value not in choices:
            raise InvalidRequest(
                f"{attribute.name} must be one of {', '.join(map(str, choices))}, got {value!r}",
                param=attribute.name,
            )

    return check


def _budget(value: Any) -> int | str | None:
    try:
        return parse_budget(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="kv_budget") from None


def _template_args(value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(
            'chat_template_args must be an object, e.g. {"enable_thinking": false}',
            param="chat_template_args",
        )
    return dict(value)


def _request_defaults(settings: EngineSettings, attribute, value) -> None:
    """The request defaults are checked where their type lives (SamplingParams)."""
    SamplingParams(**settings.request_defaults)


@attrs.frozen
class EngineSettings:
    batch: int = setting(
        8, validator=_at_least(1), aliases=("--decode-concurrency",),
        help="most requests decoding at once; 1 pins every request to the serial lane, "
        "for arrival-independent results",
    )  # fmt: skip
    prefill_step_size: int = setting(
        2048, validator=_at_least(1), help="prompt tokens per prefill chunk"
    )
    # What a request that does not say gets (every API alike).
    max_tokens: int = setting(
        DEFAULT_MAX_TOKENS, validator=_at_least(1),
        help="max_tokens for a request that gives none",
    )  # fmt: skip
    temperature: float = setting(
        0.0, flag="--temp", help="temperature for a request that gives none"
    )
    top_p: float = setting(1.0, help="top_p for a request that gives none")
    top_k: int = setting(0, help="top_k for a request that gives none; 0 is off")
    min_p: float = setting(0.0, help="min_p for a request that gives none; 0 is off")
    context_length: int | None = setting(
        None, validator=_at_least(1, optional=True), parse=int, shown="the model's",
        help="the longest prompt plus max_tokens a request may have",
    )  # fmt: skip
    dtype: str | None = setting(
        None, validator=_dtype, shown="as stored",
        help=f"weights dtype, one of {', '.join(DTYPES)}; auto casts to float32 on a CPU "
        "device, where it is the fast dtype",
    )  # fmt: skip
    trust_remote_code: bool = setting(
        False, validator=_boolean,
        help="load a model whose config names its own architecture file (``model_file``, "
        "as mlx-lm's ``trust_remote_code``): that file runs as Python in this process",
    )  # fmt: skip
    prompt_cache_size: int = setting(
        10, validator=_at_least(0), help="most prompt-cache entries; 0 turns the cache off"
    )
    prompt_cache_bytes: int | None = setting(
        None, validator=_at_least(0, optional=True), parse=parse_bytes,
        shown="no cap but the KV budget",
        help="most prompt-cache bytes, e.g. 2G",
    )  # fmt: skip
    chat_template: str | None = setting(
        None, shown="the tokenizer's", help="a Jinja chat template to use instead"
    )
    chat_template_args: Mapping[str, Any] = setting(
        factory=dict, parse=dict, converter=_template_args, shown="{}",
        help="JSON object of extra arguments for the chat template",
    )  # fmt: skip
    kv_budget: int | str | None = setting(
        "auto", converter=_budget, parse=str,
        help="KV cache bytes the live rows and the prompt cache share (e.g. 8G); auto is "
        "device memory minus the weights and 20%% headroom, none is no bound; rows that "
        "do not fit wait in the queue, a row that could never fit is refused",
    )  # fmt: skip
    kv_bits: int | None = setting(
        None, validator=_one_of(BITS, optional=True), parse=int, shown="off",
        help="quantize the KV cache to this many bits (8 or 4; mlx-lm's --kv-bits), in the "
        "batch, the prompt cache and the disk tier alike; a batch holds one precision, so a "
        "row joining a quantized batch is quantized then (docs/quantized-kv.md)",
    )  # fmt: skip
    kv_group_size: int = setting(
        64, validator=_one_of(GROUP_SIZES),
        help="values sharing one scale and bias in quantized KV (mlx-lm's --kv-group-size)",
    )  # fmt: skip
    quantized_kv_start: int = setting(
        DEFAULT_QUANTIZED_KV_START, validator=_at_least(0),
        help="with --kv-bits: a row's KV is quantized once it holds this many tokens "
        "(mlx-lm's --quantized-kv-start), and a batch once one of its rows does",
    )  # fmt: skip
    prompt_cache_dir: str | None = setting(
        None, shown="~/.cache/mlx-nursery/kv/<model>/<dtype>",
        help="the prompt cache's disk tier: where entries are kept across restarts",
    )  # fmt: skip
    prompt_cache_disk: int | None = setting(
        None, validator=_at_least(0, optional=True), parse=parse_bytes,
        shown="10%% of the free disk, at most 16G",
        help="most bytes the disk tier keeps, e.g. 20G; 0 turns it off",
    )  # fmt: skip
    # Rows waiting for admission beyond this are refused (Overloaded; HTTP 429 with
    # Retry-After). None: QUEUE_PER_SLOT per batch slot.
    max_queued_requests: int | None = setting(
        None, validator=_at_least(0, optional=True), parse=int,
        shown=f"{QUEUE_PER_SLOT} per batch slot",
        help="requests waiting for a slot beyond this are refused (HTTP 429 with Retry-After)",
    )  # fmt: skip
    queue_timeout: float | None = setting(
        None, validator=_seconds(optional=True), parse=float, shown="none",
        help="seconds a request may wait in the queue before it fails (HTTP 503)",
    )  # fmt: skip
    pause_after: float | None = setting(
        0.5, validator=_seconds(optional=True), parse=_off_or_float,
        help="seconds a session below its share of the batch waits for a free slot before "
        "a row of a session over its share is paused for it (its KV kept, resumed "
        "token-exact); off never pauses",
    )  # fmt: skip
    priorities: bool = setting(
        True, validator=_boolean, parse=_on_off, shown="on",
        help="requests are scheduled by class: interactive (a person, a main agent), then "
        "sub-agents, then background work (titles, summaries), each from its request's "
        "priority or read from Claude Code's traffic (docs/sessions.md); off: every "
        "request is interactive (first come, first served within the session shares)",
    )  # fmt: skip
    priority_aging: float | None = setting(
        30.0, validator=_seconds(optional=True), parse=_off_or_float,
        help="seconds of waiting that lift a queued request one class (a sub-agent ranks "
        "with interactive requests after this, background after twice this), so no class "
        "starves; off never lifts one",
    )  # fmt: skip
    priority_room: int = setting(
        0, validator=_at_least(0), parse=int,
        help="batch slots a worse class leaves free while a better one runs (the main "
        "agent's turn beside its sub-agents): the better class's decode steps are smaller, "
        "at the worse class's throughput (docs/sessions.md)",
    )  # fmt: skip
    ragged_attention: bool = setting(
        True, validator=_boolean, parse=_on_off, shown="on",
        help="decode steps whose rows' lengths differ widely attend row by row over each "
        "row's own keys instead of over the batch padded to its longest row "
        "(actors/kernels/ragged.py); off: mlx-lm's padded attention. A choice for the process",
    )  # fmt: skip
    cpu_softmax: bool = setting(
        True, validator=_boolean, parse=_on_off, shown="on",
        help="float32 attention over prefill chunks on a Linux x86-64 CPU computes mlx's "
        "softmax in a small C library built on first use, many lanes wide and to the same "
        "bits (actors/step/cpu_attention.py); verify steps take it too, their query heads folded "
        "into one matmul per key head, and attention over --kv-bits caches (decode, verify, "
        "prefill) its quantized attention; off, or without a C compiler: mlx's own. A "
        "choice for the process",
    )  # fmt: skip
    compile: str = setting(
        "auto", validator=_one_of(("auto", "on", "off")), parse=str.lower,
        help="decode steps run the model's RMSNorm and RoPE under mx.compile, their "
        "operations fused, to the same bits (actors/kernels/fused.py); auto: on a CPU device, "
        "where it was measured to pay (1.04-1.19x a forward), off elsewhere, where those "
        "are single kernels already",
    )  # fmt: skip
    packed_weights: bool = setting(
        True, validator=_boolean, parse=_on_off, shown="on",
        help="decode steps multiply float32 weights from a copy packed once at load (the "
        "small products from the weight in place, on two threads), in a small C++ mlx "
        "extension built on first use, with OpenBLAS's own arithmetic: the same bits, "
        "checked per weight shape and row count at load (actors/kernels/packed.py); a second "
        "copy of the packed weights in memory. Where the bits differ (another BLAS or CPU), "
        "or off: mlx's matmul",
    )  # fmt: skip
    pipeline: int = setting(
        2, validator=_at_least(0), parse=_depth, shown="2", converter=_steps,
        help="how many decode steps the loop keeps queued on the GPU thread. 2: the thread "
        "goes from step to step without waiting for the loop at all, so the event loop's turn "
        "(emitting, stop checks, SSE, stats) runs beside the steps; on (1): the next step is "
        "queued before the last one's tokens go out, and a row joins a step sooner than at 2 "
        "(the batch-scenario goldens are played at 1). Rows that end ride the steps already "
        "queued, their tokens from them dropped and their KV cut back (docs/batching.md). "
        "off (0): one step at a time",
    )  # fmt: skip
    warmup: bool = setting(
        True, validator=_boolean, parse=_on_off, shown="on",
        help="before the engine takes requests (before a server's /health turns 200), run "
        "what a first request runs, once, on scratch state: a prompt prefilled, decode steps "
        "alone and at each batch size up to 8 (actors/step/warmup.py), so the first use of a "
        "kernel, a compiled block or a shape never falls on the first user",
    )  # fmt: skip
    speculative: bool = setting(
        True, validator=_boolean, parse=_on_off, shown="on",
        help="speculative decoding in the continuous batch: rows draft tokens by n-gram "
        "lookup in their own prompt and output and in recent rows' (actors/speculation/), "
        "verified in one forward, only where the measured step cost pays for them; a "
        "request can say speculative: false",
    )  # fmt: skip
    draft_tokens: int = setting(
        MAX_DRAFT, validator=_at_least(1),
        help="most draft tokens a row carries into one decode step",
    )  # fmt: skip
    draft_model: str | None = setting(
        None, parse=str, shown="none",
        help="a small model of the same tokenizer (a path, GGUF file or known name, as "
        "for the model) that drafts for every row instead of the n-gram lookups, its KV "
        "kept per row beside the target's",
    )  # fmt: skip
    # A GPU call running longer than this marks the engine unhealthy (/health 503).
    step_timeout: float = setting(
        120.0, validator=[_seconds(), _request_defaults],
        help="a GPU call running longer than this turns /health to 503 until it completes",
    )  # fmt: skip

    @property
    def request_defaults(self) -> dict[str, Any]:
        """What a request gets for the sampling fields it does not give."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "min_p")
        return {name: getattr(self, name) for name in names}

    @property
    def kv(self) -> KvBits | None:
        """The KV quantization, or None (float KV)."""
        if self.kv_bits is None:
            return None
        return KvBits(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    @property
    def queue_limit(self) -> int:
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUE_PER_SLOT * self.batch

    @property
    def template(self) -> dict[str, Any]:
        """Keyword arguments for every chat-template rendering."""
        out = dict(self.chat_template_args)
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        return out
