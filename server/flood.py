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

``docs/sessions.md`` reports it; ``bench/benchsuite.py --flood`` runs it against
a server with and without sessions, and ``tests/test_sessions.py`` on the golden
model.
"""

from __future__ import annotations

import random
import statistics
import time

import attrs
import httpx
import trio

from .bench import WORDS

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


async def _ask(client, spec, session, system, messages, max_tokens, errors) -> dict | None:
    body = {"model": spec.model, "max_tokens": max_tokens, "temperature": 0.0,
            "system": system, "messages": messages}  # fmt: skip
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
    rng = random.Random(spec.seed)
    errors: list[str] = []
    finished = 0
    stop = trio.Event()
    limits = httpx.Limits(max_connections=spec.agents + 4)
    async with httpx.AsyncClient(base_url=spec.url, timeout=spec.timeout, limits=limits) as client:

        shared = f"You are a sub-agent. Tools: {_text(rng, spec.agent_system_words)}"
        warm = trio.Event()

        async def agent(i: int) -> None:
            nonlocal finished
            own = random.Random(spec.seed * 1000 + i)
            n = 0
            while not stop.is_set():
                task = f"Sub-agent {i}, task {n}: {_text(own, spec.task_words)}"
                messages = [{"role": "user", "content": task}]
                if await _ask(client, spec, "flood-A", shared, messages, spec.agent_tokens,
                              errors) is not None:  # fmt: skip
                    finished += 1
                    if finished >= spec.warmup_requests:
                        warm.set()
                n += 1

        turns: list[float] = []
        cached: list[float] = []
        b_tokens = 0
        system = f"You are the main agent. Context: {_text(rng, spec.history_words)}"
        messages: list[dict] = []

        async def turn(n: int) -> dict | None:
            messages.append({"role": "user", "content": f"Turn {n}: {_text(rng, 40)}"})
            out = await _ask(client, spec, "flood-B", system, messages, spec.turn_tokens, errors)
            if out is not None:
                answer = "".join(b["text"] for b in out["content"] if b["type"] == "text")
                messages.append({"role": "assistant", "content": answer or "(nothing)"})
            return out

        def size(out: dict | None) -> int | None:  # a turn's prompt and answer, in tokens
            if out is None:
                return None
            u = out["usage"]
            return u["input_tokens"] + u["cache_read_input_tokens"] + u["output_tokens"]

        # The server's tokens and seconds by phase, read at each boundary: the
        # phase that just ended gets what was generated since the last read.
        phases = {"before": [0.0, 0], "turns": [0.0, 0], "gaps": [0.0, 0]}
        last = [0.0, 0]

        async def lap(ended: str | None, less: int = 0) -> None:
            generated, _ = await _generated(client)
            now = time.perf_counter()
            if ended is not None:
                phases[ended][0] += now - last[0]
                phases[ended][1] += generated - last[1] - less
            last[:] = [now, generated]

        before = agents and main and spec.before > 0  # A measured ahead of B's turns
        # B talked before it fanned out: its history is warm, as in a session
        history = size(await turn(0)) if main else None
        async with trio.open_nursery() as nursery:
            if agents:
                for i in range(spec.agents):
                    nursery.start_soon(agent, i)
                with trio.move_on_after(spec.warmup_timeout):
                    await warm.wait()
                if before:
                    await lap(None)
                    await trio.sleep(spec.before)
            before_tokens, before_paused = await _generated(client)
            start = time.perf_counter()
            if main:
                await lap("before" if before else None)
                for n in range(1, spec.turns + 1):
                    if n > 1:
                        await trio.sleep(spec.gap)
                        await lap("gaps")
                    t0 = time.perf_counter()
                    out = await turn(n)
                    turns.append(time.perf_counter() - t0)
                    await lap("turns", 0 if out is None else out["usage"]["output_tokens"])
                    if out is None:
                        break
                    if history is not None:
                        cached.append(out["usage"]["cache_read_input_tokens"] / history)
                    history = size(out)
                    b_tokens += out["usage"]["output_tokens"]
            else:
                await trio.sleep(spec.window)
            seconds = time.perf_counter() - start
            after_tokens, after_paused = await _generated(client)
            stop.set()
        total = (after_tokens - before_tokens) / seconds
        rate = (after_tokens - before_tokens - b_tokens) / seconds if agents else None
        by_phase = [t / s if agents and main and s > 0 else None for s, t in phases.values()]
        return FloodReport(tuple(turns), tuple(cached), rate, total, finished, seconds,
                           after_paused - before_paused, tuple(errors), *by_phase)  # fmt: skip
