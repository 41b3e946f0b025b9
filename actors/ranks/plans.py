"""Plans: each GPU call rank 0 makes, as a follower replays it.

A plan is the call and its host-side arguments (token ids, row indices, chunk
bounds), pickled with every mlx-holding object replaced by a number both ranks
give it (:class:`Plans`). The classes a plan mirrors register themselves here
with :func:`mirrored` (the batch, a joiner's prefill, the prompt-cache store, a
serial-lane generation), so this module never imports the actors above it.
"""

from __future__ import annotations

import collections
import enum
import functools
import io
import itertools
import pickle
import types
import weakref
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..request import SamplingParams
from ..row import Row


class Mirrored(enum.Enum):
    """The kinds of mlx-holding object a follower keeps a copy of."""

    STORE = "store"  # the prompt cache's store: made on the event loop
    BATCH = "batch"  # the running batch: made empty on the event loop, or in a call
    PREFILL = "prefill"  # a joiner's prefill job: made on the event loop
    GENERATION = "generation"  # a serial-lane row's generate_step: made in a call


_CLASSES: dict[Mirrored, type] = {}


def mirrored(kind: Mirrored):
    """Class decorator: plans number this class's objects and follow their life."""

    def register(cls: type) -> type:
        _CLASSES[kind] = cls
        return cls

    return register


@attrs.frozen
class _RowStandIn:
    """What a follower knows of a serial-lane row: its prompt and token cap."""

    prompt: list[int]
    params: Any
    id: int = 0


def _follower_params(max_tokens: int) -> Any:
    return SamplingParams(max_tokens=max_tokens)  # greedy, no processors: never read


# The fields of a joiner's prefill that the event loop sets between GPU calls.
_PREFILL_FIELDS = ("done", "taken", "started", "snapshot_at", "caches", "snapshots", "row_id")


class Plans:
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
    """The classes a plan treats apart (looked up once every actor has registered)."""
    c = _CLASSES
    return types.SimpleNamespace(
        array=mx.array, Store=c[Mirrored.STORE], SamplingParams=SamplingParams, Row=Row,
        Batch=c[Mirrored.BATCH], Prefill=c[Mirrored.PREFILL],
        mirrored=(_BaseCache, *c.values()), held=tuple(c.values()),
    )  # fmt: skip


class Pickler(pickle.Pickler):
    """Rank 0's plans (``walk`` False), and both ranks' walks after a call."""

    def __init__(self, file: Any, plans: Plans, *, lead: bool, walk: bool) -> None:
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


class Unpickler(pickle.Unpickler):
    """A follower's side: ids back to its own objects; only our own names."""

    def __init__(self, file: Any, plans: Plans) -> None:
        super().__init__(file)
        self._plans = plans

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a plan named {module}.{name}, which is not ours")

    def persistent_load(self, pid: Any) -> Any:
        k = _kinds()
        Store, Batch, Prefill = k.Store, k.Batch, k.Prefill
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


def walk(plans: Plans, args: Any, result: Any, *, lead: bool) -> None:
    """Number what a call made, in the same order on every rank."""
    Pickler(_Discard(), plans, lead=lead, walk=True).dump((args, result))


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


def held_kv(plans: Plans) -> int:
    """KV bytes a follower holds: its batches, joiners, store and serial rows."""
    held = _kinds().held
    return sum(obj.nbytes for obj in plans.held() if isinstance(obj, held))
