"""A recording proxy for real clients: a TCP relay on loopback that keeps every
byte each way, then reads the HTTP exchanges back out with h11 (requests with
their bodies, the status each got). It changes nothing in between, so a client
streams through it exactly as it would to the server."""

from __future__ import annotations

import json
from typing import Any

import attrs
import h11
import trio


@attrs.define
class Exchange:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None
    response: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define
class Recording:
    """What passed through the proxy, one byte log per connection each way."""

    upstream: tuple[str, int]
    port: int = 0
    _logs: list[tuple[bytearray, bytearray]] = attrs.field(factory=list)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        up, down = bytearray(), bytearray()
        self._logs.append((up, down))
        try:
            server = await trio.open_tcp_stream(*self.upstream)
        except OSError:
            await client.aclose()
            return

        async def pump(src: trio.abc.Stream, dst: trio.abc.Stream, log: bytearray) -> None:
            try:
                while data := await src.receive_some(65536):
                    log += data
                    await dst.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                with trio.move_on_after(1) as scope:
                    scope.shield = True
                    await dst.aclose()

        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, up)
            nursery.start_soon(pump, server, client, down)

    def exchanges(self) -> list[Exchange]:
        out = []
        for up, down in self._logs:
            out.extend(_parse(bytes(up), bytes(down)))
        return out


def _parse(up: bytes, down: bytes) -> list[Exchange]:
    """The exchanges of one connection (keep-alive: several in a row)."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(up)
    exchanges: list[Exchange] = []
    current: Exchange | None = None
    while True:
        try:
            event = server.next_event()
        except h11.RemoteProtocolError:
            break
        if isinstance(event, h11.Request):
            headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            current = Exchange(event.method.decode(), event.target.decode(), headers, b"")
            exchanges.append(current)
        elif isinstance(event, h11.Data) and current is not None:
            current.body += event.data
        elif isinstance(event, h11.EndOfMessage):
            if server.our_state is h11.SEND_RESPONSE:
                # answer locally so the parser moves to the next request
                server.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                server.send(h11.EndOfMessage())
                if server.their_state is h11.DONE and server.our_state is h11.DONE:
                    try:
                        server.start_next_cycle()
                    except h11.LocalProtocolError:
                        break
        elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            break
    _responses(down, exchanges)
    return exchanges


def _responses(down: bytes, exchanges: list[Exchange]) -> None:
    """The status (and body) each request of the connection got, in order."""
    conn = h11.Connection(h11.CLIENT)
    received = False
    for ex in exchanges:
        conn.send(h11.Request(method=ex.method, target=ex.target,
                              headers=[("host", ex.headers.get("host", "x"))]))  # fmt: skip
        conn.send(h11.EndOfMessage())
        if not received:
            conn.receive_data(down)
            received = True
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return
            if isinstance(event, h11.Response):
                ex.status = event.status_code
            elif isinstance(event, h11.Data):
                ex.response += event.data
            elif isinstance(event, h11.EndOfMessage):
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return
                break
            elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return
