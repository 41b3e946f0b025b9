"""The plan connection between rank 0 and each follower: where rank 0 listens,
how it is announced, and how its frames and lines are read."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx

HEARTBEAT_SECONDS = 0.5  # a follower's figures reach rank 0 this often
RANK_TIMEOUT = 5.0  # a follower silent this long has stalled: the ranks are lost
CONNECT_TIMEOUT = 120.0  # followers must connect to rank 0 within this after loading
LENGTH = struct.Struct("!Q")  # each plan's frame starts with its length


def rank0_host() -> str:
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


def announce(group: Any, port: int = 0, token: int = 0) -> tuple[int, int]:
    """Rank 0 tells every rank its plan port and a connection token (one all_sum)."""
    values = mx.array([port, token >> 16, token & 0xFFFF], dtype=mx.int32)
    summed = mx.distributed.all_sum(values, group=group, stream=mx.cpu).tolist()
    return summed[0], (summed[1] << 16) | summed[2]


def read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise ConnectionError("closed before a full line")
        data += chunk
    return data
