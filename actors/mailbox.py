"""Mailboxes: the channel pair of one actor, and the rule that owners close ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import trio


@attrs.frozen
class Mailbox:
    """One actor's mailbox: the send end (cloned for each producer) and the inbox."""

    send: trio.MemorySendChannel
    inbox: trio.MemoryReceiveChannel

    @classmethod
    def open(cls, size: int) -> Mailbox:
        return cls(*trio.open_memory_channel(size))

    def clone(self) -> trio.MemorySendChannel:
        return self.send.clone()


@contextlib.contextmanager
def closing(*channels: trio.abc.AsyncResource | None) -> Iterator[None]:
    """Close every channel end an actor owns (None: not wired) when its loop ends,
    so the actors reading them see ``EndOfChannel``."""
    with contextlib.ExitStack() as stack:
        for channel in channels:
            if channel is not None:
                stack.enter_context(channel)
        yield
