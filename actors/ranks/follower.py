"""A follower's life: connect to rank 0, replay each plan's call on this rank's
shard, and send a heartbeat with its figures."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from .link import CONNECT_TIMEOUT, HEARTBEAT_SECONDS, LENGTH, announce, rank0_host
from .plans import Plans, Unpickler, held_kv, walk

log = logging.getLogger("mlx_nursery.ranks")


def follow(model: Any, group: Any) -> int:
    """A follower's life (blocking; its caller loaded ``model`` as rank 0 did):
    connect to rank 0, then run each plan's call until rank 0 closes the
    connection. Returns the plans run."""
    port, token = announce(group)
    host = rank0_host()
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello = {"rank": group.rank(), "token": token, "pid": os.getpid(), "host": socket.gethostname()}
    sock.sendall(json.dumps(hello).encode() + b"\n")
    plans = Plans(model)
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
            head = reader.read(LENGTH.size)
            if len(head) < LENGTH.size:
                return n  # rank 0 closed: the engine is done
            (size,) = LENGTH.unpack(head)
            dropped, fn, args = Unpickler(io.BytesIO(reader.read(size)), plans).load()
            plans.drop(dropped)
            t0 = time.perf_counter()
            try:
                result = fn(*args)
            except Exception as exc:  # the same call raised on rank 0 (or will)
                log.warning("rank %d: %s raised %r", group.rank(), _name(fn), exc)
                result = None
            seconds = time.perf_counter() - t0
            walk(plans, args, result, lead=False)
            n += 1
            with lock:
                figures["calls"] = n
                figures["busy_seconds"] += seconds
                figures["step_seconds"] = seconds
                figures["kv_bytes"] = held_kv(plans)
    finally:
        stop.set()
        sock.close()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", repr(fn))
