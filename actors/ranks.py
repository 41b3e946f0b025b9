"""Scale-out: one engine sharded across ``mlx.distributed`` ranks.

Rank 0 runs the actor graph (and the HTTP front) as on one machine. Every other
rank runs a *follower*: it holds its shard of the weights and of every KV cache,
and executes the same GPU calls in the same order. Tensors cross between ranks
only inside the model, through mlx's own collectives (mlx-lm's ``shard()`` puts
an ``all_sum`` after each attention and MLP block). What rank 0 sends a follower
before each GPU call is a *plan*: the call and its host-side arguments (token
ids, row indices, chunk bounds, sampling left out), pickled with every
mlx-holding object (a batch, a joiner's prefill, a cache layer, the prompt-cache
store) replaced by an id both ranks give it. A follower resolves the ids to its
own objects, runs the call, and both ranks then number the objects the call
made, in the same order (see :class:`_Plans`).

Sampling happens on rank 0 only. With tensor parallelism the logits are complete
on every rank (the head is not sharded, the last block's ``all_sum`` is), so
rank 0 alone runs the samplers, logits processors and grammar masks; the token
ids it sampled reach the followers inside the next forward: the model's input
goes through one ``all_sum`` to which followers add zeros (:class:`SharedInputs`),
a few bytes per row and step, with no host round trip, so the pipelined step
stays pipelined.

Failure: collectives do not time out, so rank 0 watches its followers. Each
holds one TCP connection to rank 0 (plans one way, a heartbeat with its figures
every ``HEARTBEAT_SECONDS`` the other). A connection that closes, or a follower
silent for ``RANK_TIMEOUT``, loses the ranks: ``/health`` turns 503 with the
reason and every pending and later GPU call raises :class:`RanksLost`, so every
live row ends with an error (see ``Gpu.lose``). A follower whose connection to
rank 0 ends exits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import itertools
import json
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

import attrs
import trio

from .errors import EngineError, InvalidRequest

log = logging.getLogger("mlx_nursery.ranks")

HEARTBEAT_SECONDS = 0.5  # a follower's figures reach rank 0 this often
RANK_TIMEOUT = 5.0  # a follower silent this long has stalled: the ranks are lost
CONNECT_TIMEOUT = 120.0  # followers must connect to rank 0 within this after loading
_LENGTH = struct.Struct("!Q")


class RanksLost(EngineError):
    """A follower died or stalled: the sharded engine cannot run another step."""


# -- loading --------------------------------------------------------------------


def shard_error(config: dict, ranks: int, name: str = "the model") -> str | None:
    """Why ``config``'s model cannot be split ``ranks`` ways (None: it can).
    Tensor parallelism splits attention by heads and the MLP by columns."""
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    mlp = config.get("intermediate_size")
    bad = [
        f"{n} {what}"
        for n, what in ((heads, "attention heads"), (kv, "KV heads"), (mlp, "MLP columns"))
        if isinstance(n, int) and n % ranks
    ]
    if not bad:
        return None
    fits = [
        k
        for k in range(2, 9)
        if all(not isinstance(n, int) or n % k == 0 for n in (heads, kv, mlp))
    ]
    hint = f"; it splits {' or '.join(map(str, fits))} ways" if fits else ""
    return (
        f"{name} cannot be split {ranks} ways: its {' and '.join(bad)} do not divide "
        f"by {ranks}{hint}"
    )


def check_shardable(path: str | Path, ranks: int) -> None:
    """Raise :class:`InvalidRequest` where the model at ``path`` cannot be split."""
    config_file = Path(path) / "config.json"
    if ranks <= 1 or not config_file.is_file():
        return
    problem = shard_error(json.loads(config_file.read_text()), ranks, Path(path).name)
    if problem:
        raise InvalidRequest(problem, param="ranks")


def sharded_load(path: str | Path, group: Any) -> tuple[Any, Any]:
    """mlx-lm's ``sharded_load``: tensor parallel where the model has ``shard()``,
    else pipeline where it has ``pipeline()``."""
    from mlx_lm.utils import load_model as lazy_model
    from mlx_lm.utils import sharded_load as mlx_sharded_load

    check_shardable(path, group.size())
    model, _ = lazy_model(Path(path), lazy=True, strict=False)
    if hasattr(model, "shard"):
        return mlx_sharded_load(str(path), tensor_group=group)
    return mlx_sharded_load(str(path), pipeline_group=group)


class SharedInputs:
    """The model as every rank calls it: its token ids go through one
    ``all_sum`` first, to which followers add zeros, so every rank forwards the
    ids rank 0 chose (sampled there, in the graph, never read back to the host).
    A follower's own ids are multiplied by zero rather than replaced, which keeps
    this ``all_sum`` after the last forward's in every rank's graph."""

    def __init__(self, model: Any, group: Any) -> None:
        self._model, self._group, self._lead = model, group, group.rank() == 0

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        ids = inputs.astype(mx.int32)
        if not self._lead:
            ids = ids * 0
        return self._model(mx.distributed.all_sum(ids, group=self._group), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


# -- plans ----------------------------------------------------------------------


@attrs.frozen
class _RowStandIn:
    """What a follower knows of a serial-lane row: its prompt and token cap."""

    prompt: list[int]
    params: Any
    id: int = 0


def _follower_params(max_tokens: int) -> Any:
    from .request import SamplingParams

    return SamplingParams(max_tokens=max_tokens)  # greedy, no processors: never read


# The fields of a joiner's prefill that the event loop sets between GPU calls.
_PREFILL_FIELDS = ("done", "taken", "started", "snapshot_at", "caches", "snapshots", "row_id")


class _Plans:
    """Numbers the mlx-holding objects a plan refers to, the same on every rank.

    Rank 0 numbers an object when it first appears: made on the event loop (a
    joiner's prefill, an empty batch, the store) it is sent as "new" with what a
    follower needs to make its own; made inside a GPU call (a primed batch, a
    take's clone, an extract) it is numbered by the walk both ranks run over the
    call's arguments and result once the call is done, in the same order. Rank 0
    notes the numbers of objects it has dropped; the next plan tells followers to
    drop theirs."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._count = itertools.count()
        self._next = 0
        self._objects: dict[int, Any] = {}  # follower: number -> object (held)
        self._numbers: dict[int, tuple[int, Any]] = {}  # id(object) -> (number, weakref)
        self.dropped: collections.deque = collections.deque()  # rank 0: (number, id)

    # numbering
    def number_of(self, obj: Any) -> int | None:
        entry = self._numbers.get(id(obj))
        if entry is None:
            return None
        number, ref = entry
        return number if ref() is obj else None

    def number(self, obj: Any, *, lead: bool, number: int | None = None) -> int:
        if number is None:
            number = self._next
        self._next = max(self._next, number + 1)
        key = id(obj)
        if lead:
            ref = weakref.ref(obj, lambda _r, n=number, k=key: self.dropped.append((n, k)))
        else:
            self._objects[number] = obj
            ref = weakref.ref(obj)
        self._numbers[key] = (number, ref)
        return number

    def get(self, number: int) -> Any:
        return self._objects[number]

    def take_dropped(self) -> list[int]:
        """Rank 0: the numbers dropped since the last plan (forgotten here too)."""
        out = []
        while self.dropped:
            number, key = self.dropped.popleft()
            entry = self._numbers.get(key)
            if entry is not None and entry[0] == number:
                del self._numbers[key]
            out.append(number)
        return out

    def drop(self, numbers: list[int]) -> None:
        """Follower: let go of objects rank 0 dropped."""
        for number in numbers:
            obj = self._objects.pop(number, None)
            if obj is not None:
                self._numbers.pop(id(obj), None)

    def held(self) -> list[Any]:
        return list(self._objects.values())


# Values pickled as they are, asked about first (pickle asks about every object,
# each token id of a prompt included).
_PLAIN = frozenset({int, float, str, bool, bytes, type(None), list, tuple, dict, set})


@functools.cache
def _kinds() -> types.SimpleNamespace:
    """The classes a plan treats apart (imported once, late: they import mlx)."""
    import mlx.core as mx
    from mlx_lm.models.cache import _BaseCache

    from .prompt_cache import Store
    from .request import SamplingParams
    from .row import Row
    from .rows import Batch, Prefill
    from .serial import _Generation

    return types.SimpleNamespace(
        array=mx.array, Store=Store, SamplingParams=SamplingParams, Row=Row,
        Batch=Batch, Prefill=Prefill, mirrored=(_BaseCache, Batch, Store, _Generation),
    )  # fmt: skip


class _Pickler(pickle.Pickler):
    """Rank 0's plans (``walk`` False), and both ranks' walks after a call."""

    def __init__(self, file: Any, plans: _Plans, *, lead: bool, walk: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._plans, self._lead, self._walk = plans, lead, walk

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:
            return None
        k, plans = _kinds(), self._plans
        Prefill, Row, SamplingParams = k.Prefill, k.Row, k.SamplingParams
        if obj is plans.model:
            return ("model",)
        if isinstance(obj, Prefill):
            number, prompt = plans.number_of(obj), None
            if number is None:
                number, prompt = plans.number(obj, lead=self._lead), obj.prompt
            state = tuple(getattr(obj, f) for f in _PREFILL_FIELDS)
            return ("prefill", number, prompt, obj.step_size, state)
        if isinstance(obj, Row):
            return ("row", obj.prompt, obj.params.max_tokens)
        if isinstance(obj, SamplingParams):
            return ("params", obj.max_tokens)
        if isinstance(obj, BaseException):
            return ("error", f"{type(obj).__name__}: {obj}")
        if isinstance(obj, k.array):
            raise TypeError("an mlx array reached a plan: plans carry host values only")
        if not isinstance(obj, k.mirrored):
            return None
        number = plans.number_of(obj)
        if number is not None:
            return ("ref", number)
        if self._walk:
            return ("ref", plans.number(obj, lead=self._lead))
        if isinstance(obj, k.Store):
            return ("store", plans.number(obj, lead=True), obj.max_size, obj.max_bytes)
        if isinstance(obj, k.Batch) and not obj.slots:
            return ("batch", plans.number(obj, lead=True))
        raise TypeError(f"a {type(obj).__name__} reached a plan before the followers had one")


# What a plan may name: our modules' functions and classes, and pickle's own helpers.
_ALLOWED_MODULES = ("mlx_nursery.actors.",)
_ALLOWED = {("builtins", "getattr"), ("builtins", "set"), ("builtins", "frozenset"),
            ("copyreg", "_reconstructor"), ("copyreg", "__newobj__"),
            ("builtins", "object")}  # fmt: skip


class _Unpickler(pickle.Unpickler):
    """A follower's side: ids back to its own objects; only our own names."""

    def __init__(self, file: Any, plans: _Plans) -> None:
        super().__init__(file)
        self._plans = plans

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a plan named {module}.{name}, which is not ours")

    def persistent_load(self, pid: Any) -> Any:
        from .prompt_cache import Store
        from .rows import Batch, Prefill

        plans, kind = self._plans, pid[0]
        if kind == "model":
            return plans.model
        if kind == "ref":
            return plans.get(pid[1])
        if kind == "prefill":
            _, number, prompt, step_size, state = pid
            if prompt is not None:
                job = Prefill(plans.model, list(prompt), _follower_params(1), step_size)
                plans.number(job, lead=False, number=number)
            job = plans.get(number)
            for field, value in zip(_PREFILL_FIELDS, state, strict=True):
                setattr(job, field, value)
            return job
        if kind == "row":
            return _RowStandIn(list(pid[1]), _follower_params(pid[2]))
        if kind == "params":
            return _follower_params(pid[1])
        if kind == "error":
            return RuntimeError(pid[1])
        if kind == "store":
            store = Store(max_size=pid[2], max_bytes=pid[3])
            plans.number(store, lead=False, number=pid[1])
            return store
        if kind == "batch":
            batch = Batch(plans.model)
            plans.number(batch, lead=False, number=pid[1])
            return batch
        raise pickle.UnpicklingError(f"unknown plan id {pid!r}")


def _walk(plans: _Plans, args: Any, result: Any, *, lead: bool) -> None:
    """Number what a call made, in the same order on every rank."""
    _Pickler(_Discard(), plans, lead=lead, walk=True).dump((args, result))


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


# -- rank 0 -----------------------------------------------------------------------


@attrs.define(eq=False)
class Follower:
    rank: int
    host: str
    pid: int
    sock: socket.socket
    figures: dict = attrs.field(factory=dict)  # its last heartbeat
    heard: float = attrs.field(factory=time.monotonic)


@attrs.define(eq=False)
class Leader:
    """Rank 0's end: sends each GPU call's plan to every follower, then walks
    the call (GPU thread); its followers' figures come in on the event loop."""

    plans: _Plans
    followers: list[Follower]
    plan_bytes: int = 0  # sent to each follower so far
    plans_sent: int = 0
    plan_seconds: float = 0.0  # GPU-thread time spent making, sending and walking plans

    def send(self, fn: Any, args: tuple) -> None:
        t0 = time.perf_counter()
        buffer = io.BytesIO()
        _Pickler(buffer, self.plans, lead=True, walk=False).dump(
            (self.plans.take_dropped(), fn, args)
        )
        payload = buffer.getvalue()
        frame = _LENGTH.pack(len(payload)) + payload
        for f in self.followers:
            f.sock.sendall(frame)
        self.plan_bytes += len(frame)
        self.plans_sent += 1
        self.plan_seconds += time.perf_counter() - t0

    def walk(self, args: tuple, result: Any) -> None:
        t0 = time.perf_counter()
        _walk(self.plans, args, result, lead=True)
        self.plan_seconds += time.perf_counter() - t0

    def close(self) -> None:
        for f in self.followers:
            with contextlib.suppress(OSError):
                f.sock.close()


def _rank0_host() -> str:
    """Rank 0's address as the launch gave it (mlx.launch's ring hostfile)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and Path(hostfile).is_file():
        try:
            hosts = json.loads(Path(hostfile).read_text() or "null")
            if hosts:
                return str(hosts[0][0]).rsplit(":", 1)[0]
        except (ValueError, IndexError, TypeError):
            pass
    return "127.0.0.1"


def _announce(group: Any, port: int = 0, token: int = 0) -> tuple[int, int]:
    """Rank 0 tells every rank its plan port and a connection token (one all_sum)."""
    import mlx.core as mx

    values = mx.array([port, token >> 16, token & 0xFFFF], dtype=mx.int32)
    summed = mx.distributed.all_sum(values, group=group, stream=mx.cpu).tolist()
    return summed[0], (summed[1] << 16) | summed[2]


def lead(model: Any, group: Any) -> Leader:
    """Rank 0, after loading (GPU thread): listen, tell the followers where, and
    take one connection from each."""
    host = _rank0_host()
    listener = socket.create_server(("0.0.0.0" if host != "127.0.0.1" else host, 0))
    token = secrets.randbits(31)
    listener.settimeout(CONNECT_TIMEOUT)
    _announce(group, listener.getsockname()[1], token)
    followers: dict[int, Follower] = {}
    with listener:
        while len(followers) < group.size() - 1:
            conn, _ = listener.accept()
            conn.settimeout(CONNECT_TIMEOUT)
            hello = json.loads(_read_line(conn))
            if hello.get("token") != token:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            r = int(hello["rank"])
            followers[r] = Follower(r, hello.get("host", "?"), int(hello.get("pid", 0)), conn)
    log.info("ranks: %d followers connected", len(followers))
    return Leader(_Plans(model), [followers[r] for r in sorted(followers)])


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise ConnectionError("closed before a full line")
        data += chunk
    return data


@attrs.define(eq=False)
class RankWatch:
    """Rank 0's actor watching its followers: reads each one's heartbeats (its
    figures, for ``/stats``); a closed connection or ``timeout`` seconds of
    silence loses the ranks (``Gpu.lose``)."""

    leader: Leader
    gpu: Any
    timeout: float = RANK_TIMEOUT

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for f in self.leader.followers:
                nursery.start_soon(self._listen, f)
            task_status.started()
            while True:
                await trio.sleep(HEARTBEAT_SECONDS)
                now = time.monotonic()
                for f in self.leader.followers:
                    if now - f.heard > self.timeout and self.gpu.lost is None:
                        self._lose(f, f"has sent nothing for {now - f.heard:.1f} s (stalled)")

    async def _listen(self, f: Follower) -> None:
        sock = trio.socket.from_stdlib_socket(f.sock.dup())
        buffer = b""
        with sock:
            while True:
                try:
                    data = await sock.recv(65536)
                except OSError as exc:
                    data, why = b"", f"connection failed ({exc})"
                else:
                    why = "closed its connection (the process ended)"
                if not data:
                    if self.gpu.lost is None and not self.gpu.stopping:
                        self._lose(f, why)
                    return
                f.heard = time.monotonic()
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line:
                        f.figures = json.loads(line)

    def _lose(self, f: Follower, why: str) -> None:
        reason = f"rank {f.rank} (pid {f.pid} on {f.host}) {why}; the sharded engine is stopped"
        log.error("ranks lost: %s", reason)
        self.gpu.lose(reason)


def rank_figures(leader: Leader, own: dict) -> list[dict]:
    """Every rank's figures, rank 0's (``own``) first."""
    out = [{"rank": 0, "pid": os.getpid(), "host": _rank0_host(), **own,
            "plan_bytes": leader.plan_bytes, "plans": leader.plans_sent,
            "plan_seconds": leader.plan_seconds}]  # fmt: skip
    for f in leader.followers:
        out.append({"rank": f.rank, "pid": f.pid, "host": f.host, **f.figures})
    return out


# -- followers ----------------------------------------------------------------------


def follow(model: Any, group: Any) -> int:
    """A follower's life (blocking; its caller loaded ``model`` as rank 0 did):
    connect to rank 0, then run each plan's call until rank 0 closes the
    connection. Returns the plans run."""
    port, token = _announce(group)
    host = _rank0_host()
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello = {"rank": group.rank(), "token": token, "pid": os.getpid(), "host": socket.gethostname()}
    sock.sendall(json.dumps(hello).encode() + b"\n")
    plans = _Plans(model)
    figures = {"calls": 0, "busy_seconds": 0.0, "step_seconds": 0.0, "kv_bytes": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            with lock:
                line = json.dumps(figures).encode() + b"\n"
            try:
                sock.sendall(line)
            except OSError:
                if stop.wait(2 * HEARTBEAT_SECONDS):
                    return  # rank 0 closed the connection: the main thread saw it
                log.error("rank %d: rank 0 is gone; exiting", group.rank())
                os._exit(1)  # the main thread may be inside a collective that never ends

    beat = threading.Thread(target=heartbeat, name="mlx-nursery-heartbeat", daemon=True)
    beat.start()
    reader = sock.makefile("rb")
    n = 0
    try:
        while True:
            head = reader.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                return n  # rank 0 closed: the engine is done
            (size,) = _LENGTH.unpack(head)
            dropped, fn, args = _Unpickler(io.BytesIO(reader.read(size)), plans).load()
            plans.drop(dropped)
            t0 = time.perf_counter()
            try:
                result = fn(*args)
            except Exception as exc:  # the same call raised on rank 0 (or will)
                log.warning("rank %d: %s raised %r", group.rank(), _name(fn), exc)
                result = None
            seconds = time.perf_counter() - t0
            _walk(plans, args, result, lead=False)
            n += 1
            with lock:
                figures["calls"] = n
                figures["busy_seconds"] += seconds
                figures["step_seconds"] = seconds
                figures["kv_bytes"] = _held_kv(plans)
    finally:
        stop.set()
        sock.close()


def _held_kv(plans: _Plans) -> int:
    """KV bytes this follower holds: its batches, joiners, store and serial row."""
    from .prompt_cache import Store
    from .rows import Batch, Prefill
    from .serial import _Generation

    total = 0
    for obj in plans.held():
        if isinstance(obj, Batch | Prefill | Store):
            total += obj.nbytes
        elif isinstance(obj, _Generation):
            total += sum(c.nbytes for c in obj.caches)
    return total


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", repr(fn))
