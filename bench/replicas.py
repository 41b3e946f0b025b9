"""Two replicas behind the router (``serve --replicas 2``): eight agents, each a
four-turn conversation over one shared ~2k-token system prompt plus its own
history, as one person's agents run (one session id each).

Three runs, each a fresh replica set on fresh disk tiers, alone on the machine:
the prefix-aware router with sticky sessions (the default), round-robin in front
of the same two replicas (the baseline), and the default again with replica 0
killed (SIGKILL) once every agent has had its first turn: each request answers
or fails with a clear error (timed from the kill), an agent retries a failed
turn, and the killed replica's return to serving is timed. Writes the
``replicas`` section of docs/benchmarks.md.

    python bench/replicas.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench")]

from benchsuite import _write_section, bench_llama, free_port  # noqa: E402
from choices import WORDS  # noqa: E402

AGENTS, TURNS, MAX_TOKENS = 8, 4, 24
SYSTEM_WORDS = 540  # some 2,000 tokens of this model's (3.6 a word)
RESULT_WORDS = 40  # a turn's own tool result: some 150 tokens, the agent's alone


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt() -> str:
    return "You are one of a team of coding agents. " + words(11, SYSTEM_WORDS)


def user_turn(agent: int, turn: int) -> str:
    """The agent's next message: what its last tool call read, then the question."""
    return (f"Agent {agent}, step {turn}. The file you read:\n"
            f"{words(1000 * agent + turn, RESULT_WORDS)}\nWhat next?")  # fmt: skip


class ReplicaSet:
    def __init__(self, model: str, policy: str, folder: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", model,
                "--port", str(self.port), "--replicas", "2", "--router-policy", policy,
                "--prompt-cache-dir", str(folder / "kv"), "--log-level", "WARNING"]  # fmt: skip
        self.log = (folder / "front.log").open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, "the replica set ended while starting"
            time.sleep(0.2)
        raise RuntimeError("the replica set did not start")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.code = None
        self.log.close()


async def agents(rs: ReplicaSet, system: str, kill_after_first: bool) -> dict:
    """Every agent's turns; with ``kill_after_first``, replica 0 is killed once all
    agents have had their first turn."""
    turns: list[dict] = []
    firsts = trio.Semaphore(0)
    killed: dict = {}

    async def agent(i: int, client: httpx.AsyncClient) -> None:
        messages = [{"role": "system", "content": system}]
        for t in range(TURNS):
            messages.append({"role": "user", "content": user_turn(i, t)})
            while True:  # a real harness sends a failed turn again
                record = await turn(client, i, t, messages)
                turns.append(record)
                if record["status"] == 200:
                    messages.append({"role": "assistant", "content": record.pop("text")})
                    break
                await trio.sleep(0.5)
            if t == 0:
                firsts.release()

    async def killer() -> None:
        for _ in range(AGENTS):
            await firsts.acquire()
        pid = rs.health()["replicas"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed["at"], killed["pid"] = time.monotonic(), pid
        while True:
            await trio.sleep(0.2)
            r = rs.health()["replicas"][0]
            if r["status"] == "serving" and r["pid"] != pid:
                killed["back"] = time.monotonic() - killed["at"]
                return

    async with httpx.AsyncClient(base_url=rs.url, timeout=120) as client, \
            trio.open_nursery() as nursery:
        for i in range(AGENTS):
            nursery.start_soon(agent, i, client)
        if kill_after_first:
            nursery.start_soon(killer)
    return {"turns": turns, "killed": killed}


async def turn(client: httpx.AsyncClient, i: int, t: int, messages: list[dict]) -> dict:
    """One turn, streamed as agents stream: its text, usage, and how it ended."""
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    record: dict = {"agent": i, "turn": t, "start": time.monotonic(), "status": 0}
    text, usage, error = [], None, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"x-session-id": f"agent-{i}"}) as r:  # fmt: skip
            record["status"] = r.status_code
            if r.status_code != 200:
                error = (await r.aread()).decode(errors="replace")
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                    for choice in chunk.get("choices", []):
                        text.append(choice["delta"].get("content") or "")
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        error = str(exc)
    record["end"] = time.monotonic()
    if error is not None or usage is None:  # refused, or the stream ended in an error event
        record["status"] = 599 if record["status"] in (0, 200) else record["status"]
        record["error"] = error or "the stream ended without its usage"
        return record
    record["text"] = "".join(text)
    record["cached"] = usage["prompt_tokens_details"]["cached_tokens"]
    record["prompt"] = usage["prompt_tokens"]
    return record


def served_by(rs: ReplicaSet) -> dict[int, int]:
    """Replica index -> requests it finished (its /stats, read again after the load)."""
    time.sleep(1.5)  # the front reads each replica's figures every 0.5 s
    stats = httpx.get(rs.url + "/stats", timeout=10).json()
    return {r["index"]: r["stats"].get("finished", 0) for r in stats["replicas"]}


def sessions_on(rs: ReplicaSet) -> dict[int, set]:
    stats = httpx.get(rs.url + "/stats", timeout=10).json()
    return {r["index"]: {x.get("session") for x in r["stats"].get("recent_requests", [])
                         if x.get("session")} for r in stats["replicas"]}  # fmt: skip


def run(model: str, policy: str, kill: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as folder:
        rs = ReplicaSet(model, policy, Path(folder))
        try:
            out = trio.run(agents, rs, system_prompt(), kill)
            out["served"], out["sessions"] = served_by(rs), sessions_on(rs)
        finally:
            rs.close()
        out["exit"] = rs.code
    later = [t for t in out["turns"] if t["status"] == 200 and t["turn"] > 0]
    shares = [t["cached"] / t["prompt"] for t in later]
    out["later_min"] = min(shares)
    out["later_mean"] = statistics.mean(shares)
    out["later_below_90"] = sum(s < 0.9 for s in shares)
    out["errors"] = [t for t in out["turns"] if t["status"] != 200]
    out["first_tokens"] = min(t["prompt"] for t in out["turns"] if t["status"] == 200)
    out["wall"] = max(t["end"] for t in out["turns"]) - min(t["start"] for t in out["turns"])
    return out


def kill_figures(out: dict) -> dict:
    at = out["killed"]["at"]
    # requests in flight at the kill or sent after it, until the load ended
    hit = [t for t in out["turns"] if t["end"] >= at and t["start"] <= at]
    failed = [t for t in out["turns"] if t["status"] != 200]
    return {
        "in_flight": len(hit), "failed": len(failed),
        "answered_in_flight": sum(t["status"] == 200 for t in hit),
        "slowest_failure": max((t["end"] - max(t["start"], at) for t in failed), default=0.0),
        "slowest_in_flight": max((t["end"] - at for t in hit), default=0.0),
        "back": out["killed"].get("back"),
    }


def markdown(model: str, sticky: dict, aware: dict, rr: dict, killed: dict) -> str:
    k = kill_figures(killed)

    def spread(o: dict) -> str:
        if o is killed:  # replica 0's figures started again with it
            return f"— / {o['served'].get(1, 0)}"
        return " / ".join(str(o["served"].get(i, 0)) for i in (0, 1))

    def row(name: str, o: dict) -> str:
        return (f"| {name} | {100 * o['later_min']:.1f}% | {100 * o['later_mean']:.1f}% | "
                f"{o['later_below_90']} | {spread(o)} | {len(o['errors'])} | {o['wall']:.1f} s |")

    return "\n".join([
        f"Two replicas of {model} (`serve --replicas 2`), {AGENTS} agents each running a "
        f"{TURNS}-turn chat over one shared ~2k-token system prompt plus its own "
        f"history (`x-session-id` a agent), {MAX_TOKENS} tokens a turn, greedy; each run a "
        f"fresh set on fresh disk tiers, alone on this 2-core VM; the system prompt is "
        f"{sticky['first_tokens']} tokens with the template and the first message, each turn "
        f"adds ~{round(3.6 * RESULT_WORDS)} tokens of the agent's own and its answer; OpenBLAS "
        "in the replicas (serve's default on Linux), float32. `bench/replicas.py`.",
        "",
        "| router | turns 2-4 cached, least | mean | turns under 90% | requests on replica 0 / 1 "
        "| errors | wall |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        row("sticky: each agent's conversation kept on one replica (default)", sticky),
        row("prefix-aware (`cache_aware`), same replicas", aware),
        row("round-robin, same replicas", rr),
        row("default, replica 0 killed after every first turn", killed),
        "",
        f"The kill: {k['in_flight']} requests in flight at it, {k['answered_in_flight']} of "
        f"them answered; {k['failed']} failed with a clear error (the slowest "
        f"{k['slowest_failure']:.2f} s after the kill; each agent sent its turn again); every "
        f"request in flight ended within {k['slowest_in_flight']:.2f} s; the load finished on "
        f"the other replica; replica 0 was serving again {k['back']:.1f} s after the kill. "
        "The set's exit code on SIGTERM: "
        + ", ".join(str(o["exit"]) for o in (sticky, aware, rr, killed)) + ".",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the 30M bench model")
    parser.add_argument("--section", default="replicas")
    args = parser.parse_args()
    model = args.model or str(bench_llama())
    sticky = run(model, "sticky", kill=False)
    aware = run(model, "cache_aware", kill=False)
    rr = run(model, "round_robin", kill=False)
    killed = run(model, "sticky", kill=True)
    body = markdown("bench-llama-30m (31M parameters)", sticky, aware, rr, killed)
    print(body)
    _write_section(args.section, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
