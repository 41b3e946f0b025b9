"""``serve --replicas``: two replicas behind the real router (SGLang's Model
Gateway, ``smg``) on loopback, driven by the real SDKs (``docs/scale-out.md``,
"Replicas"): every API streamed and not, a conversation kept where its cache
is, the headers that name sessions reaching the replica, errors in each API's
shape, a replica killed under a stream (a clear error at once, the next request
on the other, the killed one back), and SIGTERM ending the whole set."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import SERVER_TIMEOUT, free_port, model_path

HEADERS = {"x-session-id": "conversation-1"}


class ReplicaSet:
    """``mlx-nursery serve --replicas 2`` in a process of its own, its log in a file."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "front.log"
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["MLX_NURSERY_OPENBLAS"] = "0"
        argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--port",
                str(self.port), "--model", str(model_path("llama")), "--replicas", "2",
                "--prompt-cache-dir", str(tmp / "kv"), "--log-level", "INFO"]  # fmt: skip
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def said(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_serving(self, count: int = 2, seconds: float = SERVER_TIMEOUT) -> dict:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.said()
            try:
                r = self.http.get("/health")
                body = r.json()
                if r.status_code == 200 and sum(
                    x["status"] == "serving" for x in body["replicas"]
                ) >= count:
                    return body
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"not {count} replicas serving in {seconds} s: {self.said()}")

    def stats(self) -> dict:
        return self.http.get("/stats").json()


@pytest.fixture(scope="module")
def replica_set(tmp_path_factory):
    rs = ReplicaSet(tmp_path_factory.mktemp("replicas"))
    try:
        rs.wait_serving()
        yield rs
    finally:
        if rs.proc.poll() is None:
            rs.proc.kill()
            rs.proc.wait(30)
        rs.http.close()


def _openai(rs: ReplicaSet) -> openai.OpenAI:
    return openai.OpenAI(base_url=rs.url + "/v1", api_key="none", default_headers=HEADERS)


def test_health_models_and_stats_show_every_replica(replica_set):
    health = replica_set.http.get("/health").json()
    assert [r["status"] for r in health["replicas"]] == ["serving", "serving"]
    models = replica_set.http.get("/v1/models").json()
    assert len(models["data"]) == 1 and len(models["replicas"]) == 2
    stats = replica_set.stats()
    assert stats["router"]["policy"] == "sticky"
    assert {w["url"] for w in stats["router"]["workers"]} == {r["url"] for r in stats["replicas"]}
    metrics = replica_set.http.get("/metrics").text
    assert 'replica="0"' in metrics and 'replica="1"' in metrics
    page = replica_set.http.get("/")
    assert page.status_code == 200 and "/stats" in page.text


def test_every_api_answers_through_the_router_streamed_and_not(replica_set):
    client = _openai(replica_set)
    ask = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="default", messages=ask, max_tokens=6,
                                           temperature=0)  # fmt: skip
    parts = client.chat.completions.create(model="default", messages=ask, max_tokens=6,
                                           temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert whole.choices[0].message.content == text and text

    r = client.responses.create(model="default", input="Say hello.", max_output_tokens=6,
                                temperature=0)  # fmt: skip
    events = list(client.responses.create(model="default", input="Say hello.",
                                          max_output_tokens=6, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and r.output_text
    assert events[-1].response.output_text == r.output_text

    claude = anthropic.Anthropic(base_url=replica_set.url, api_key="none",
                                 default_headers=HEADERS)  # fmt: skip
    m = claude.messages.create(model="claude-sonnet-4-5", max_tokens=6, messages=ask,
                               extra_body={"temperature": 0})  # fmt: skip
    with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=6, messages=ask,
                                extra_body={"temperature": 0}) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert m.content[0].text == streamed.content[0].text
    n = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=ask)
    assert n.input_tokens > 0


def test_a_conversation_stays_where_its_cache_is(replica_set):
    """Four turns of one session: one replica, every turn after the first found
    in its cache; the session header reached it (the router passes few)."""
    client = _openai(replica_set)
    system = "You are a careful assistant. " * 40
    messages = [{"role": "system", "content": system}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: what next?"})
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=5,
                                           temperature=0)  # fmt: skip
        cached.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert min(cached[1:]) >= 0.9, cached
    holders = [r["index"] for r in replica_set.stats()["replicas"]
               if any(x.get("session") == "conversation-1"
                      for x in r["stats"].get("recent_requests", []))]  # fmt: skip
    assert len(holders) == 1, holders


def test_bad_input_is_answered_in_each_apis_shape(replica_set):
    http = replica_set.http
    r = http.post("/v1/chat/completions", json={"messages": [], "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = http.post("/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = http.post("/v1/responses", json={"input": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/chat/completions", headers={"Host": "evil.example"}, json={})
    assert r.status_code == 403


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_replica_killed_under_a_stream(replica_set, api):
    """The stream ends at once with the API's error event; the next request is
    answered by the other replica; the killed one serves again within 30 s."""
    ask = [{"role": "user", "content": "Count."}]  # greedy: some 600 tokens from this model
    body = {"chat": {"messages": ask, "max_tokens": 4000},
            "messages": {"messages": ask, "max_tokens": 4000},
            "responses": {"input": "Count.", "max_output_tokens": 4000}}[api]  # fmt: skip
    path = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
            "responses": "/v1/responses"}[api]  # fmt: skip
    session = f"victim-{api}"
    got: dict = {}

    def read() -> None:
        with replica_set.http.stream("POST", path, headers={"x-session-id": session},
                                     json={**body, "stream": True, "temperature": 0}) as r:
            got["body"] = b"".join(r.iter_raw())
            got["ended"] = time.monotonic()

    reader = threading.Thread(target=read)
    reader.start()
    victim = None
    deadline = time.monotonic() + 10
    while victim is None and time.monotonic() < deadline:  # the replica its row runs on
        live = replica_set.http.get("/v1/sessions").json()["data"]
        victim = next((s["replica"] for s in live if s["id"] == session), None)
    assert victim is not None, "the stream never ran"
    pid = replica_set.http.get("/health").json()["replicas"][victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    reader.join(30)
    assert got["ended"] - killed < 5.0
    tail = got["body"][-600:].decode()
    assert "replica_lost" in tail or "was lost" in tail, tail
    if api == "chat":
        assert tail.rstrip().endswith("data: [DONE]")
    else:
        assert "event: error" in tail
    after = replica_set.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 3})
    assert after.status_code == 200, after.text
    health = replica_set.wait_serving(2, 30.0)
    assert health["replicas"][victim]["pid"] != pid
    assert health["replicas"][victim]["restarts"] >= 1


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_a_router_that_dies_is_started_again(replica_set):
    """The router aborts (SIGABRT) under the set: it is started again on its port,
    the next request is answered, and no replica stopped."""
    pids = [r["pid"] for r in replica_set.stats()["replicas"]]
    (router,) = [g for c in _children(replica_set.proc.pid) for g in _children(c)
                 if Path(f"/proc/{g}/comm").read_text().strip() == "smg::router"]  # fmt: skip
    os.kill(router, signal.SIGABRT)
    after = replica_set.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 3})
    assert after.status_code == 200, after.text
    assert replica_set.stats()["router"]["restarts"] == 1
    assert [r["pid"] for r in replica_set.stats()["replicas"]] == pids
    assert "the router (smg) ended with code 134; starting it again" in replica_set.said()


def test_sigterm_stops_the_whole_set(replica_set):
    pids = [r["pid"] for r in replica_set.stats()["replicas"]]
    replica_set.proc.send_signal(signal.SIGTERM)
    assert replica_set.proc.wait(60) == 0, replica_set.said()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_each_replica_gets_the_fronts_flags_less_the_sets_own():
    from mlx_nursery.server.replicas import ReplicaSet, serve_flags

    argv = ["serve", "--model", "m", "--replicas", "2", "--port=9", "--api-key", "k",
            "--batch", "4", "--router-policy", "round_robin", "--prompt-cache-dir", "/kv"]
    assert serve_flags(argv) == ["--model", "m", "--batch", "4"]
    rs = ReplicaSet.of(argv, 2, ["http://elsewhere:8080/"], cache_dir="/kv",
                       memory_budget=8 << 30, key="k")  # fmt: skip
    local = [r for r in rs.replicas if r.local]
    assert [r.argv[-4:] for r in local] == [
        ["--prompt-cache-dir", "/kv/replica-0", "--memory-budget", str(4 << 30)],
        ["--prompt-cache-dir", "/kv/replica-1", "--memory-budget", str(4 << 30)],
    ]
    assert all("--replica" in r.argv and r.env["MLX_NURSERY_API_KEY"] == "k" for r in local)
    assert rs.replicas[2].url == "http://elsewhere:8080" and not rs.replicas[2].local


def test_the_tunnel_carries_the_request_whole_and_routes_on_its_prompt():
    from mlx_nursery.server.app import TUNNEL
    from mlx_nursery.server.front import tunnel_body

    body = {"model": "m", "instructions": "sys", "input": [{"role": "user", "content": "a"}],
            "max_output_tokens": 7, "stream": True}  # fmt: skip
    carried = tunnel_body("/v1/responses", body, {"session-id": "s"})
    assert carried[TUNNEL] == {"path": "/v1/responses", "headers": {"session-id": "s"},
                               "body": body}  # fmt: skip
    assert carried["max_tokens"] == 7 and carried["stream"] is True
    longer = tunnel_body("/v1/responses", {**body, "input": [*body["input"], {"role": "user",
                         "content": "b"}]}, {})  # fmt: skip
    text, more = carried["messages"][0]["content"], longer["messages"][0]["content"]
    assert more.startswith(text.rstrip("]"))  # the next turn extends this one's text


def test_a_conversation_keeps_its_routing_key_from_turn_to_turn():
    """What the sticky router pins by: the session a client names, else OpenAI's
    prompt_cache_key, else how the conversation opens (every later turn repeats it)."""
    from mlx_nursery.server.front import routing_key

    turn1 = {"model": "m", "messages": [{"role": "system", "content": "sys"},
                                        {"role": "user", "content": "a"}]}  # fmt: skip
    turn3 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "x"},
                                   {"role": "user", "content": "b"}]}  # fmt: skip
    other = {**turn1, "messages": [turn1["messages"][0], {"role": "user", "content": "c"}]}
    assert routing_key(turn1, {}) == routing_key(turn3, {}) != routing_key(other, {})
    # a named session (Claude Code's sub-agents share its id) wins over the opening
    tree = {"X-Claude-Code-Session-Id": "s1"}
    assert routing_key(turn1, tree) == routing_key(other, tree) == "session:s1"
    assert routing_key({**other, "prompt_cache_key": "k"}, {}) == "key:k"
    text = {"model": "m", "prompt": "p" * 2000}
    assert routing_key(text, {}) == routing_key({**text, "prompt": text["prompt"] + "more"}, {})


def test_a_conversation_whose_replica_died_moves_for_good():
    """Its key changes once its replica is down, so the router places it on a live
    one and keeps it there, not back on the restarted replica's empty cache."""
    from mlx_nursery.server.front import Placements

    keys = Placements()
    assert keys.key("k", {"a", "b"}) == "k"
    keys.went("k", "a")
    assert keys.key("k", {"a", "b"}) == "k"
    assert keys.key("k", {"b"}) == "k#1"  # a is down
    keys.went("k", "b")
    assert keys.key("k", {"a", "b"}) == "k#1"  # a is back: k stays on b


def test_metrics_merge_into_one_family_each_labelled_by_replica():
    from mlx_nursery.server.front import merge_metrics

    text = ("# HELP x_total X.\n# TYPE x_total counter\nx_total 1.0\n"
            '# HELP y Y.\n# TYPE y gauge\ny{model="m"} 2.0\n')  # fmt: skip
    merged = merge_metrics([(0, text), (1, text)]).splitlines()
    assert merged == ["# HELP x_total X.", "# TYPE x_total counter", 'x_total{replica="0"} 1.0',
                      'x_total{replica="1"} 1.0', "# HELP y Y.", "# TYPE y gauge",
                      'y{replica="0",model="m"} 2.0', 'y{replica="1",model="m"} 2.0']


def test_replicas_refuse_what_they_cannot_serve():
    exe = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model",
           str(model_path("llama"))]  # fmt: skip
    for extra, said in ((["--replicas", "2", "--ranks", "2"], "--ranks shards one"),
                        (["--replicas", "2", "--model", "x=y"], "serves one model"),
                        (["--replicas", "0"], "must be 1 or more"),
                        (["--replica-url", "ftp://x"], "not an http")):  # fmt: skip
        out = subprocess.run([*exe, *extra], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and said in out.stderr, (extra, out.stderr[-300:])


def test_setting_flags_that_default_to_none_take_text():
    """--prompt-cache-dir, --dtype and --chat-template were refused from the command
    line (their None default typed them as NoneType)."""
    from mlx_nursery.server.cli import build_parser, settings_from

    args = build_parser().parse_args(["serve", "--prompt-cache-dir", "/kv", "--dtype",
                                      "float32", "--chat-template", "{{ x }}"])  # fmt: skip
    engine = settings_from(args).engine
    assert (engine.prompt_cache_dir, engine.dtype, engine.chat_template) == (
        "/kv", "float32", "{{ x }}")


SSHD = Path("/usr/sbin/sshd")


def test_replicas_from_a_hostfile_start_over_ssh_restart_and_stop_with_the_set(tmp_path):
    """``--replica-hostfile``: one replica a host, started over ssh (here a private
    sshd on loopback, two host names for this machine), killed and started
    again, and ended with the set (its closed stdin drains it)."""
    if not SSHD.exists() or shutil.which("ssh") is None or os.geteuid() != 0:
        pytest.skip("needs OpenSSH's server and client and root (make test installs "
                    "openssh-server where it may)")  # fmt: skip
    ssh_port, key = free_port(), tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    str(tmp_path / "host_key")], check=True)  # fmt: skip
    (tmp_path / "authorized").write_text((tmp_path / "key.pub").read_text())
    (tmp_path / "config").write_text(
        f"Host host-a host-b\n  HostName 127.0.0.1\n  Port {ssh_port}\n  IdentityFile {key}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    sshd = subprocess.Popen([str(SSHD), "-D", "-p", str(ssh_port), "-h", str(tmp_path / "host_key"),
                             "-o", "ListenAddress=127.0.0.1", "-o", "StrictModes=no",
                             "-o", f"AuthorizedKeysFile={tmp_path / 'authorized'}",
                             "-o", "PermitRootLogin=prohibit-password"])  # fmt: skip
    hosts = tmp_path / "hosts.json"
    hosts.write_text('{"hosts": [{"ssh": "host-a", "ips": ["127.0.0.1"]}, '
                     '{"ssh": "host-b", "ips": ["127.0.0.1"]}]}')  # fmt: skip
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(MLX_NURSERY_OPENBLAS="0", MLX_NURSERY_SSH=f"ssh -F {tmp_path / 'config'}")
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--port", str(port),
            "--model", str(model_path("llama")), "--replicas", "0", "--replica-hostfile",
            str(hosts)]  # fmt: skip
    log = (tmp_path / "front.log").open("w")
    front = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        health = _until(http, lambda h: [r["status"] for r in h["replicas"]] == ["serving"] * 2)
        assert [r["host"] for r in health["replicas"]] == ["host-a", "host-b"]
        assert [r["url"] for r in health["replicas"]] == [
            f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        served = subprocess.run(["pgrep", "-f", f"serve.*--port {port + 1}( |$)"],
                                capture_output=True, text=True).stdout.split()  # fmt: skip
        remote = [p for p in served  # the replica on host-a itself, not its ssh
                  if Path(f"/proc/{p}/cmdline").read_bytes().startswith(sys.executable.encode())]
        os.kill(int(remote[0]), signal.SIGKILL)
        health = _until(http, lambda h: h["replicas"][0]["restarts"] >= 1
                        and h["replicas"][0]["status"] == "serving")  # fmt: skip
        front.send_signal(signal.SIGTERM)
        assert front.wait(60) == 0
        time.sleep(2)
        left = subprocess.run(["pgrep", "-f", f"serve.*--port {port + 2}( |$)"],
                              capture_output=True, text=True).stdout.split()  # fmt: skip
        assert not left, "a replica outlived its set"
    finally:
        http.close()
        if front.poll() is None:
            front.kill()
        sshd.terminate()
        sshd.wait(10)
        log.close()


def _until(http: httpx.Client, ok, seconds: float = 60.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            body = http.get("/health").json()
            if body["status"] == "ok" and ok(body):
                return body
        except (httpx.TransportError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)
    raise AssertionError("the replica set did not get there in time")


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def test_a_killed_front_leaves_no_replica_and_no_router(tmp_path):
    """SIGKILL gives the front no stop: its replicas end when their piped stdin
    closes, and the router under its guard the same way."""
    rs = ReplicaSet(tmp_path)
    try:
        rs.wait_serving()
        under = _descendants(rs.proc.pid)
        assert len(under) >= 4, under  # two replicas, the router's guard and the router
        rs.proc.kill()
        rs.proc.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in under):
            time.sleep(0.2)
        assert not [p for p in under if Path(f"/proc/{p}").exists()], rs.said()
    finally:
        rs.http.close()
        if rs.proc.poll() is None:
            rs.proc.kill()
