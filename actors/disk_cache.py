"""The prompt cache's disk tier: prefixes that outlive memory and restarts.

One file per entry, in mlx-lm's prompt-cache format (``save_prompt_cache``: a
safetensors file of the layers' states, their class names and our metadata),
under ``<root>/<model>/<dtype>/``. What is ours, and why:

- **The name carries the checksum**: ``<token-hash>-<sha256 of the file>.safetensors``.
  A file is written to a ``.tmp-`` name, fsynced, hashed, renamed, and the folder
  fsynced: a reader never sees a half-written file under a final name, and a
  truncated or flipped byte fails the check before mlx reads anything.
- **The metadata carries the model's identity** (a hash of every parameter's
  name, shape, dtype and first and last values) and the entry's token ids, so the
  index is rebuilt at start from the headers alone (read without mlx), and a file
  another model wrote is never loaded.
- **Bad files are removed with one log line**: a header that does not parse, a
  size that is not the header's, another model's identity (at start), a checksum
  that does not match (at load). None of them is ever a crash.

The index is the event loop's (one owner, the prompt-cache actor); file work
runs on worker threads, and the only mlx work (freezing an entry before a write,
loading one) runs on the GPU thread. Writes never wait on the GPU thread: the
disk tier (``disk_tier.Disk``) queues them and one writer task drains the queue
(``disk_writer.py``), writing a long entry ``WRITE_DELAY`` seconds after its put unless the
conversation's next turn supersedes it first (a flush, at shutdown, writes
everything queued at once).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import trio
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
)

from .models.vision import shows_images
from .paths import cache_root, sha256
from .step.kv import SOLO, clone
from .step.quantized import first

log = logging.getLogger("mlx_nursery.engine")

FORMAT = "mlx-nursery-kv/1"
KV_DIR_ENV = "MLX_NURSERY_KV_DIR"  # the disk tier's root (default: <cache>/kv)
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"

# An entry with at least this many tokens is written soon after it is put (a
# long prefix is worth keeping across restarts); shorter ones are written when
# memory evicts them.
LONG_PREFIX = 1024
# The default size cap: this share of the free disk where the tier lives, at most
# DEFAULT_DISK_MAX.
DEFAULT_DISK_SHARE = 0.10
DEFAULT_DISK_MAX = 16 << 30
# A long entry is written this many seconds after its put, unless a longer entry
# of the same conversation supersedes it first: an agent taking a turn every few
# seconds is written once it pauses (or at shutdown), not at every turn.
WRITE_DELAY = 10.0
# Writes waiting beyond this are dropped, oldest first (each holds its KV alive).
MAX_PENDING = 8
_MAX_HEADER = 64 << 20


class BadFile(Exception):
    """A cache file that cannot be used; the message says why."""


def kv_root() -> Path:
    env = os.environ.get(KV_DIR_ENV)
    return Path(env) if env else cache_root() / "kv"


def default_dir(model_id: str, dtype: str) -> Path:
    return kv_root() / _slug(model_id) / dtype


def default_cap(folder: Path) -> int:
    """A modest share of the free disk: 10% of it, at most 16 GiB."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return min(DEFAULT_DISK_MAX, int(free * DEFAULT_DISK_SHARE))


def _slug(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return keep.strip(".-") or "model"


def model_identity(model: Any) -> tuple[str, str]:
    """The model's identity (a hash over every parameter's name, shape, dtype,
    first and last values) and its floating dtype's name (GPU thread)."""
    params = tree_flatten(model.parameters())
    ends = [mx.concatenate([p.reshape(-1)[:4], p.reshape(-1)[-4:]]) for _, p in params]
    ends = [e.astype(mx.float32) if mx.issubdtype(e.dtype, mx.floating) else e for e in ends]
    mx.eval(ends)
    digest = hashlib.sha256()
    dtype = "float32"
    for (name, p), e in zip(params, ends, strict=True):
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        digest.update(np.asarray(e).tobytes())
        if mx.issubdtype(p.dtype, mx.floating):
            dtype = str(p.dtype).removeprefix("mlx.core.")
    return digest.hexdigest()[:32], dtype


async def open_tier(
    gpu: Any, model: Any, model_id: str, folder: str | None, cap: int | None, kv: Any = None
) -> DiskTier | None:
    """The disk tier for ``model``: its identity (GPU thread), its folder indexed
    (a worker thread), bad files removed, the cap applied. None, with a log line,
    when the folder cannot be used: the engine then runs on memory alone. Under
    ``kv`` (a ``KvBits``) entries hold quantized KV: the identity and the default
    folder name the precision, so a hit is always of the precision served."""
    identity, dtype = await gpu.call_here(model_identity, model)
    if kv is not None:
        tag = f"kv{kv.bits}-g{kv.group_size}-s{kv.start}"
        identity, dtype = f"{identity}-{tag}", f"{dtype}-{tag}"
    try:
        vision = getattr(model, "vision", None)  # a vision model's (models/vision.py)
        tier = await trio.to_thread.run_sync(_open, folder, model_id, dtype, identity, cap,
                                             None if vision is None else vision.images)  # fmt: skip
    except OSError as exc:
        log.warning("prompt cache: no disk tier, %s cannot be used: %s", folder, exc)
        return None
    log.info(
        "prompt cache: disk tier at %s, %d entries, %.1f of %.1f GB",
        tier.root, len(tier.entries), tier.nbytes / 1e9, tier.cap / 1e9,
    )  # fmt: skip
    return tier


def _open(folder: str | None, model_id: str, dtype: str, identity: str, cap: int | None,
          images: Any = None) -> DiskTier:  # fmt: skip
    root = Path(os.path.expanduser(folder)) if folder else default_dir(model_id, dtype)
    tier = DiskTier(root, identity, default_cap(root) if cap is None else cap, images)
    tier.scan()
    remove(tier.over_cap())
    return tier


# -- on the GPU thread ------------------------------------------------------------


@attrs.frozen
class Frozen:
    """An entry ready for a writer thread: every array evaluated, no lazy op left."""

    caches: list[Any]
    nbytes: int
    trimmable: bool


def freeze(caches: Sequence[Any]) -> Frozen | None:
    """Copies of ``caches`` a writer thread can serialize without running mlx:
    plain KV cut to its length, everything evaluated. None when a layer's class
    is not mlx-lm's (its loader could not rebuild it)."""
    if any(type(c).__module__ != "mlx_lm.models.cache" for c in caches):
        return None
    out = []
    for c in caches:
        f = clone(c)
        if type(c) in SOLO and c.keys is not None and c.offset < first(c.keys).shape[2]:
            n = c.offset
            f.keys, f.values = tree_map(lambda a, n=n: a[..., :n, :], (c.keys, c.values))
        out.append(f)
    mx.eval([f.state for f in out])
    return Frozen(out, sum(f.nbytes for f in out), can_trim_prompt_cache(out))


def load(path: Path) -> list[Any]:
    """An entry's caches from its (checked) file."""
    caches = load_prompt_cache(str(path))
    mx.eval([c.state for c in caches])
    return caches


# -- the index (event loop) and file work (worker threads) -----------------------


@attrs.define(eq=False)
class DiskEntry:
    tokens: np.ndarray = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    path: Path
    nbytes: int
    trimmable: bool
    kind: str
    used: float  # last written or loaded (the file's mtime across restarts)

    def usable(self, prompt: np.ndarray) -> int:
        """How many of ``prompt``'s tokens this entry can serve."""
        return serves(self.tokens, self.trimmable, prompt)

    def covers(self, tokens: np.ndarray) -> bool:
        return holds(self.tokens, self.trimmable, tokens)


def shared_length(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading tokens two prompts share (vectorised; lists or arrays)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def serves(held: np.ndarray, trimmable: bool, prompt: np.ndarray) -> int:
    """How many of ``prompt``'s tokens an entry of ``held`` tokens can serve (the
    last prompt token is always forwarded)."""
    limit = len(prompt) - 1
    shared = shared_length(held, prompt)
    if trimmable:
        return min(shared, limit)
    return len(held) if shared == len(held) <= limit else 0


def serving_most(entries: Iterable[Any], prompt: np.ndarray) -> tuple[Any | None, int]:
    """Of ``entries`` (each with ``usable``), the one serving most of ``prompt``,
    and how many tokens (None and 0 when none serves any)."""
    best, most = None, 0
    for entry in entries:
        n = entry.usable(prompt)
        if n > most:
            best, most = entry, n
    return best, most


def holds(held: np.ndarray, trimmable: bool, tokens: np.ndarray) -> bool:
    """Whether an entry of ``held`` tokens holds ``tokens``' KV: the same tokens,
    or more that start with them, where the entry can be cut back."""
    if len(tokens) > len(held) or (len(tokens) < len(held) and not trimmable):
        return False
    return bool(np.array_equal(held[: len(tokens)], tokens))


def as_tokens(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


@attrs.define(eq=False)
class DiskTier:
    root: Path
    identity: str
    cap: int  # bytes
    # A vision model's image runs (``models.vision.Images``): an entry that shows
    # images records their hashes, and is read back as this process places them.
    images: Any = None
    entries: dict[str, DiskEntry] = attrs.field(factory=dict, init=False)  # by file name
    # Loads in progress, by file name, and the entries unindexed meanwhile (a
    # longer entry superseded them, or the cap): their files go when the last
    # load of them ends, not under it.
    _readers: collections.Counter = attrs.field(factory=collections.Counter, init=False)
    _doomed: dict[str, DiskEntry] = attrs.field(factory=dict, init=False)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    # worker thread
    def scan(self) -> int:
        """Index the folder's files; remove stale temporaries and bad files (one
        log line each). Returns how many files were removed as bad."""
        self.root.mkdir(parents=True, exist_ok=True)
        bad = 0
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(TMP_PREFIX):
                _remove(path)  # a write a previous process did not finish
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                entry = self._entry(path)
            except BadFile as exc:
                self.drop(path, str(exc))
                bad += 1
                continue
            self.entries[path.name] = entry
        return bad

    def _entry(self, path: Path) -> DiskEntry:
        meta, size = read_header(path)
        if meta.get("format") != FORMAT:
            raise BadFile(f"not a {FORMAT} file")
        if meta.get("model") != self.identity:
            raise BadFile("written by another model (its identity differs)")
        try:
            tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<i4").astype(np.int32)
            trimmable, kind = meta["trimmable"] == "1", meta["kind"]
            shown = {int(r): sha for r, sha in json.loads(meta.get("images", "{}")).items()}
        except (KeyError, ValueError) as exc:
            raise BadFile(f"its metadata is incomplete ({exc})") from None
        if shown:
            if self.images is None:
                raise BadFile("it shows images, and this model takes none")
            tokens = self.images.here(tokens, shown)
        stat = path.stat()
        if stat.st_size != size:
            raise BadFile(f"truncated or padded: {stat.st_size} bytes, its header says {size}")
        return DiskEntry(tokens, path, size, trimmable, kind, stat.st_mtime)

    def drop(self, path: Path, why: str) -> None:
        log.warning("prompt cache: removed %s: %s", path, why)
        self.entries.pop(path.name, None)
        _remove(path)

    # event loop
    def nearest(self, prompt: Sequence[int]) -> tuple[DiskEntry | None, int]:
        """The entry serving most of ``prompt``, and how many tokens."""
        return serving_most(self.entries.values(), as_tokens(prompt))

    def covered(self, tokens: np.ndarray) -> bool:
        return any(e.covers(tokens) for e in self.entries.values())

    def reading(self, entry: DiskEntry) -> None:
        """A load of ``entry`` begins: its file stays until :meth:`read` ends it."""
        self._readers[entry.path.name] += 1

    def read(self, entry: DiskEntry) -> list[DiskEntry]:
        """A load of ``entry`` ended; returns what the caller removes now (the
        entry, if it was unindexed meanwhile and no other load holds it)."""
        name = entry.path.name
        self._readers[name] -= 1
        if self._readers[name] > 0:
            return []
        del self._readers[name]
        gone = self._doomed.pop(name, None)
        return [gone] if gone is not None else []

    def _unheld(self, gone: list[DiskEntry]) -> list[DiskEntry]:
        """Of unindexed entries, those no load holds (the rest wait for theirs)."""
        self._doomed.update((e.path.name, e) for e in gone if e.path.name in self._readers)
        return [e for e in gone if e.path.name not in self._readers]

    # worker thread
    def verify(self, entry: DiskEntry) -> None:
        """Check the file against the checksum in its name (raises BadFile)."""
        want = entry.path.name.removesuffix(SUFFIX).rpartition("-")[2]
        try:
            got = sha256(entry.path)
        except OSError as exc:
            raise BadFile(f"unreadable ({exc})") from None
        if not want or not got.startswith(want):
            raise BadFile("its checksum does not match its contents")
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path, (now, now))
        entry.used = now

    def write(self, tokens: np.ndarray, frozen: Frozen, kind: str) -> DiskEntry:
        """Write one entry atomically; returns its index entry (not yet indexed)."""
        raw = tokens.astype("<i4").tobytes()
        metadata = {
            "format": FORMAT,
            "model": self.identity,
            "tokens": base64.b64encode(raw).decode(),
            "trimmable": "1" if frozen.trimmable else "0",
            "kind": kind,
        }
        if self.images is not None and shows_images(tokens):  # by hash: ids are this process's
            metadata["images"] = json.dumps(self.images.shown(tokens))
        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}{SUFFIX}"
        try:
            save_prompt_cache(str(tmp), frozen.caches, metadata)
            with tmp.open("rb+") as f:
                os.fsync(f.fileno())
            digest = sha256(tmp)
            key = hashlib.sha256(raw).hexdigest()[:16]
            path = self.root / f"{key}-{digest[:32]}{SUFFIX}"
            os.replace(tmp, path)
            _fsync_dir(self.root)
        finally:
            _remove(tmp)
        return DiskEntry(tokens, path, path.stat().st_size, frozen.trimmable, kind, time.time())

    def add(self, entry: DiskEntry) -> list[DiskEntry]:
        """Index a written entry; returns the entries it supersedes (a trimmable
        entry that holds a prefix of it) and the oldest ones past the cap, which
        the caller removes (in a thread); one being loaded goes when its load ends."""
        gone = [e for e in self.entries.values() if e.path != entry.path and entry.trimmable
                and len(e.tokens) < len(entry.tokens) and entry.covers(e.tokens)]  # fmt: skip
        for e in gone:
            del self.entries[e.path.name]
        self.entries[entry.path.name] = entry
        return self._unheld(gone + self.over_cap(keep=entry))

    def over_cap(self, keep: DiskEntry | None = None) -> list[DiskEntry]:
        """Unindex the least recently used entries until the tier fits its cap."""
        out = []
        total = self.nbytes
        for e in sorted(self.entries.values(), key=lambda e: e.used):
            if total <= self.cap:
                break
            if e is keep:
                continue
            del self.entries[e.path.name]
            total -= e.nbytes
            out.append(e)
        return out


def read_header(path: Path) -> tuple[dict[str, str], int]:
    """A safetensors file's metadata (ours: mlx-lm nests it under ``0.``) and the
    size its header implies, read without mlx (raises BadFile)."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise BadFile("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise BadFile(f"its header claims {length} bytes")
            raw = f.read(length)
        header = json.loads(raw)
        meta = header.pop("__metadata__", {})
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except BadFile:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise BadFile(f"its header does not parse ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise BadFile("its metadata is not an object")
    ours = {k.removeprefix("0."): v for k, v in meta.items() if k.startswith("0.")}
    return ours, 8 + length + end


def remove(entries: Sequence[DiskEntry]) -> None:
    for e in entries:
        _remove(e.path)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
