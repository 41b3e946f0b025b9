"""The agent-tree flood: one session's sub-agents against another's main agent.

Session A keeps ``agents`` sub-agent requests in flight (each sends its next as
its last one ends); session B, the main agent the user talks to, runs a
``turns``-turn conversation over a longer history meanwhile. Both speak
Anthropic Messages with Claude Code's session header, as Claude Code does.
B's history is warm when the flood starts (its turn 0 runs first, unmeasured):
the main agent talked before it fanned out. Measured: each later B turn's
latency (request to its last token: what the user waits for), how much of each
B turn's history (the last turn's prompt and answer) the prompt cache served,
and A's completion tok/s over B's run (the server's generated-token count, less
B's), and everyone's. A's rate is also taken apart in the same server: over
``before`` seconds ahead of B's first turn, while B's turns run, and in B's
gaps; the host's drift between runs cannot move these ratios.

With ``subagents``, A's requests are B's own sub-agents in B's session, in
Claude Code's shape (issue #64: the main agent ahead of its own sub-agents).

``docs/sessions.md`` reports it; ``bench/benchsuite.py --flood`` runs it against
a server with and without sessions, and ``tests/test_sessions.py`` on the golden
model (``tests/conftest.py`` puts ``bench/`` on the path).
"""

from __future__ import annotations

import random
import statistics
import time

import attrs
import httpx
import trio
from mlx_nursery.server.bench import WORDS

SESSION_HEADER = "X-Claude-Code-Session-Id"  # what Claude Code sends on every request


@attrs.frozen
class FloodSpec:
    url: str
    agents: int = 12  # A's requests in flight
    turns: int = 4  # B's conversation
    history_words: int = 1000  # B's context before its first turn (about a token a word)
    agent_system_words: int = 300  # A's system prompt (and tools), the same for each
    task_words: int = 50  # each A request's own task after it
    agent_tokens: int = 128  # each A answer
    turn_tokens: int = 32  # each B answer
    gap: float = 1.0  # seconds between B's turns (the user reads, a tool runs)
    before: float = 10.0  # seconds A is measured, once warm, before B's first turn
    # B's first turn waits until A has finished this many requests (A's steady
    # state: every sub-agent past its first prefill), or ``warmup_timeout``.
    warmup_requests: int = 24
    warmup_timeout: float = 300.0
    window: float = 30.0  # seconds A is measured alone when there is no B
    sessions: bool = True  # send the session header (False: every request alone)
    # A's requests are B's own sub-agents, as Claude Code sends them: B's session,
    # the attribution line with ``cc_is_subagent=true;``, and every request with
    # tools (B's attribution line without the flag): the server reads B as
    # interactive and A as sub-agents (docs/sessions.md).
    subagents: bool = False
    model: str = "default_model"
    seed: int = 0
    timeout: float = 600.0


@attrs.frozen
class FloodReport:
    turn_seconds: tuple[float, ...]  # B's turns, request to last token
    history_cached: tuple[float, ...]  # each B turn: its history served from the cache
    agent_tokens_per_second: float | None  # A's, over B's run (or the window)
    tokens_per_second: float  # everyone's (A's and B's), over the same
    agent_requests: int  # A's requests finished
    seconds: float  # the measured window
    paused: int  # rows the server paused meanwhile (its /stats)
    errors: tuple[str, ...]
    # A's tok/s in the same server: before B's first turn, while B's turns ran,
    # and between them (None: A or B not in this run, or the phase never ran).
    agent_before: float | None = None
    agent_in_turns: float | None = None
    agent_between: float | None = None

    @property
    def turn_median(self) -> float | None:
        return statistics.median(self.turn_seconds) if self.turn_seconds else None


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _headers(spec: FloodSpec, session: str) -> dict[str, str]:
    return {SESSION_HEADER: session} if spec.sessions else {}


# Claude Code's attribution line (main agent, sub-agent) and a tool list for the
# ``subagents`` flood.
ATTRIBUTION = "x-anthropic-billing-header: cc_version=2.1.197.3d1; cc_entrypoint=cli;"
SUBAGENT = ATTRIBUTION + " cc_is_subagent=true;"
READ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [{"name": "Read", "description": "Read a file", "input_schema": READ}]


async def _ask(client, spec, session, system, messages, max_tokens, errors) -> dict | None:
    body = {"model": spec.model, "max_tokens": max_tokens, "temperature": 0.0,
            "system": system, "messages": messages}  # fmt: skip
    if spec.subagents:
        line = SUBAGENT if session == "flood-A" else ATTRIBUTION
        body |= {"system": [{"type": "text", "text": line}, {"type": "text", "text": system}],
                 "tools": TOOLS}  # fmt: skip
        session = "flood-B"
    r = await client.post("/v1/messages", json=body, headers=_headers(spec, session))
    if r.status_code != 200:
        errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
        return None
    return r.json()


async def _generated(client: httpx.AsyncClient) -> tuple[int, int]:
    s = (await client.get("/stats")).json()
    return s["generated_tokens"], s.get("paused", 0)


async def run_flood(spec: FloodSpec, *, agents: bool = True, main: bool = True) -> FloodReport:
    """One flood: A's sub-agents (``agents``) and B's turns (``main``), or either alone."""
    limits = httpx.Limits(max_connections=spec.agents + 4)
    async with httpx.AsyncClient(base_url=spec.url, timeout=spec.timeout, limits=limits) as client:
        return await _Flood(spec, client, agents, main).run()


@attrs.define(eq=False)
class _Flood:
    """One flood's state: A's sub-agents, B's conversation, the phases' figures."""

    spec: FloodSpec
    client: httpx.AsyncClient
    agents: bool
    main: bool
    rng: random.Random = attrs.field(init=False)
    shared: str = attrs.field(init=False)  # A's system prompt
    system: str = attrs.field(init=False)  # B's
    errors: list[str] = attrs.field(factory=list)
    finished: int = 0  # A's requests
    stop: trio.Event = attrs.field(factory=trio.Event)
    warm: trio.Event = attrs.field(factory=trio.Event)
    messages: list[dict] = attrs.field(factory=list)  # B's conversation
    turns: list[float] = attrs.field(factory=list)
    cached: list[float] = attrs.field(factory=list)
    b_tokens: int = 0
    # The server's tokens and seconds by phase, read at each boundary: the
    # phase that just ended gets what was generated since the last read.
    phases: dict[str, list] = attrs.field(
        factory=lambda: {"before": [0.0, 0], "turns": [0.0, 0], "gaps": [0.0, 0]}
    )
    last: list = attrs.field(factory=lambda: [0.0, 0])

    def __attrs_post_init__(self) -> None:
        self.rng = random.Random(self.spec.seed)
        self.shared = f"You are a sub-agent. Tools: {_text(self.rng, self.spec.agent_system_words)}"
        self.system = f"You are the main agent. Context: {_text(self.rng, self.spec.history_words)}"

    async def agent(self, i: int) -> None:
        """One of A's sub-agents: each request as the last one ends, until stopped."""
        spec, own, n = self.spec, random.Random(self.spec.seed * 1000 + i), 0
        while not self.stop.is_set():
            task = f"Sub-agent {i}, task {n}: {_text(own, spec.task_words)}"
            messages = [{"role": "user", "content": task}]
            out = await _ask(self.client, spec, "flood-A", self.shared, messages,
                             spec.agent_tokens, self.errors)  # fmt: skip
            if out is not None:
                self.finished += 1
                if self.finished >= spec.warmup_requests:
                    self.warm.set()
            n += 1

    async def turn(self, n: int) -> dict | None:
        """B's turn ``n``: one more user message, its answer kept in the history."""
        self.messages.append({"role": "user", "content": f"Turn {n}: {_text(self.rng, 40)}"})
        out = await _ask(self.client, self.spec, "flood-B", self.system, self.messages,
                         self.spec.turn_tokens, self.errors)  # fmt: skip
        if out is not None:
            answer = "".join(b["text"] for b in out["content"] if b["type"] == "text")
            self.messages.append({"role": "assistant", "content": answer or "(nothing)"})
        return out

    async def lap(self, ended: str | None, less: int = 0) -> None:
        generated, _ = await _generated(self.client)
        now = time.perf_counter()
        if ended is not None:
            self.phases[ended][0] += now - self.last[0]
            self.phases[ended][1] += generated - self.last[1] - less
        self.last[:] = [now, generated]

    async def b_turns(self, history: int | None, before: bool) -> None:
        """B's measured turns, ``gap`` seconds apart."""
        await self.lap("before" if before else None)
        for n in range(1, self.spec.turns + 1):
            if n > 1:
                await trio.sleep(self.spec.gap)
                await self.lap("gaps")
            t0 = time.perf_counter()
            out = await self.turn(n)
            self.turns.append(time.perf_counter() - t0)
            await self.lap("turns", 0 if out is None else out["usage"]["output_tokens"])
            if out is None:
                break
            if history is not None:
                self.cached.append(out["usage"]["cache_read_input_tokens"] / history)
            history = _size(out)
            self.b_tokens += out["usage"]["output_tokens"]

    async def run(self) -> FloodReport:
        spec, agents, main = self.spec, self.agents, self.main
        before = agents and main and spec.before > 0  # A measured ahead of B's turns
        # B talked before it fanned out: its history is warm, as in a session
        history = _size(await self.turn(0)) if main else None
        async with trio.open_nursery() as nursery:
            if agents:
                for i in range(spec.agents):
                    nursery.start_soon(self.agent, i)
                with trio.move_on_after(spec.warmup_timeout):
                    await self.warm.wait()
                if before:
                    await self.lap(None)
                    await trio.sleep(spec.before)
            before_tokens, before_paused = await _generated(self.client)
            start = time.perf_counter()
            if main:
                await self.b_turns(history, before)
            else:
                await trio.sleep(spec.window)
            seconds = time.perf_counter() - start
            after_tokens, after_paused = await _generated(self.client)
            self.stop.set()
        total = (after_tokens - before_tokens) / seconds
        rate = (after_tokens - before_tokens - self.b_tokens) / seconds if agents else None
        by_phase = [t / s if agents and main and s > 0 else None for s, t in self.phases.values()]
        return FloodReport(tuple(self.turns), tuple(self.cached), rate, total, self.finished,
                           seconds, after_paused - before_paused, tuple(self.errors),
                           *by_phase)  # fmt: skip


def _size(out: dict | None) -> int | None:
    """A turn's prompt and answer, in tokens."""
    if out is None:
        return None
    u = out["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["output_tokens"]
