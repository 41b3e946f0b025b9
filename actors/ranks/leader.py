"""Rank 0's end: plans out to every follower, and the watch on their heartbeats."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import secrets
import socket
import time
from typing import Any

import attrs
import trio

from .link import (
    CONNECT_TIMEOUT,
    HEARTBEAT_SECONDS,
    LENGTH,
    RANK_TIMEOUT,
    announce,
    rank0_host,
    read_line,
)
from .plans import Pickler, Plans, walk

log = logging.getLogger("mlx_nursery.ranks")


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

    plans: Plans
    followers: list[Follower]
    plan_bytes: int = 0  # sent to each follower so far
    plans_sent: int = 0
    plan_seconds: float = 0.0  # GPU-thread time spent making, sending and walking plans

    def send(self, fn: Any, args: tuple) -> None:
        t0 = time.perf_counter()
        buffer = io.BytesIO()
        Pickler(buffer, self.plans, lead=True, walk=False).dump(
            (self.plans.take_dropped(), fn, args)
        )
        payload = buffer.getvalue()
        frame = LENGTH.pack(len(payload)) + payload
        for f in self.followers:
            f.sock.sendall(frame)
        self.plan_bytes += len(frame)
        self.plans_sent += 1
        self.plan_seconds += time.perf_counter() - t0

    def walk(self, args: tuple, result: Any) -> None:
        t0 = time.perf_counter()
        walk(self.plans, args, result, lead=True)
        self.plan_seconds += time.perf_counter() - t0

    def blame(self, seconds: float = 1.0) -> str | None:
        """Which follower's connection has closed, looked for up to ``seconds``
        (a collective that failed because a rank died reports only a lost peer;
        the dead rank's plan connection closes with it)."""
        deadline = time.monotonic() + seconds
        while True:
            for f in self.followers:
                try:
                    closed = f.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    return f"rank {f.rank} (pid {f.pid} on {f.host}) closed its connection"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        for f in self.followers:
            with contextlib.suppress(OSError):
                f.sock.close()


def lead(model: Any, group: Any) -> Leader:
    """Rank 0, after loading (GPU thread): listen, tell the followers where, and
    take one connection from each."""
    host = rank0_host()
    listener = socket.create_server(("0.0.0.0" if host != "127.0.0.1" else host, 0))
    token = secrets.randbits(31)
    listener.settimeout(CONNECT_TIMEOUT)
    announce(group, listener.getsockname()[1], token)
    followers: dict[int, Follower] = {}
    with listener:
        while len(followers) < group.size() - 1:
            conn, _ = listener.accept()
            conn.settimeout(CONNECT_TIMEOUT)
            hello = json.loads(read_line(conn))
            if hello.get("token") != token:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            r = int(hello["rank"])
            followers[r] = Follower(r, hello.get("host", "?"), int(hello.get("pid", 0)), conn)
    log.info("ranks: %d followers connected", len(followers))
    return Leader(Plans(model), [followers[r] for r in sorted(followers)])


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
                    if now - f.heard <= self.timeout or self.gpu.lost is not None:
                        continue
                    if _unread(f.sock):  # it did send: this loop was late to read it
                        f.heard = now
                        continue
                    self._lose(f, f"has sent nothing for {now - f.heard:.1f} s (stalled)")

    async def _listen(self, f: Follower) -> None:
        """Read a follower's heartbeats. ``heard`` is set before the bytes are
        taken, with no checkpoint between (a trio socket's ``recv`` yields after
        it has read): the watch never finds them gone while ``heard`` is old."""
        sock = f.sock.dup()
        sock.setblocking(False)  # as trio's own sockets are
        buffer = b""
        with sock:
            while True:
                await trio.lowlevel.wait_readable(sock)
                f.heard = time.monotonic()
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    data, why = b"", f"connection failed ({exc})"
                else:
                    why = "closed its connection (the process ended)"
                if not data:
                    if self.gpu.lost is None and not self.gpu.stopping:
                        self._lose(f, why)
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line:
                        f.figures = json.loads(line)

    def _lose(self, f: Follower, why: str) -> None:
        reason = f"rank {f.rank} (pid {f.pid} on {f.host}) {why}; the sharded engine is stopped"
        log.error("ranks lost: %s", reason)
        self.gpu.lose(reason)


def _unread(sock: socket.socket) -> bool:
    """Whether bytes wait unread on a follower's connection. ``heard`` is when
    the listener last woke to read, so after this process's event loop was held
    up longer than the timeout (a long call holding the GIL, a starved core) the
    watch can run before the listener has read heartbeats that did arrive."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (EAGAIN), or the connection failed
        return False


def rank_figures(leader: Leader, own: dict) -> list[dict]:
    """Every rank's figures, rank 0's (``own``) first."""
    out = [{"rank": 0, "pid": os.getpid(), "host": rank0_host(), **own,
            "plan_bytes": leader.plan_bytes, "plans": leader.plans_sent,
            "plan_seconds": leader.plan_seconds}]  # fmt: skip
    for f in leader.followers:
        out.append({"rank": f.rank, "pid": f.pid, "host": f.host, **f.figures})
    return out
