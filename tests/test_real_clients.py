"""The real clients, unchanged and at their defaults, against the server: Claude
Code (`claude -p`), the Codex CLI (`codex exec`) and the OpenAI Agents SDK (a
tool loop on both its Responses and its chat-completions model). Each talks to
a real server through a recording proxy on loopback; every request it sends
must get a 2xx and every run must finish. Their telemetry is off, their HOME is
fresh, their only base URL is the proxy's: nothing they do leaves this machine.

The clients are pinned and installed once by `make clients` (part of `make
test`) into ~/.cache/mlx-nursery/clients (or $MLX_NURSERY_CLIENTS). The model is
a tiny random model with a long context whose answers end by construction
(goldens/make_client_model.py: a free answer is one word, a string in a call or
a schema holds one word and closes): the protocol is under test, not the answers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from clients import agents_sdk, assert_all_2xx, client_bin, posts, quiet_env, recorded_run
from conftest import GOLDENS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client_model() -> str:
    sys.path.insert(0, str(GOLDENS))
    from make_client_model import ensure

    return f"client-llama={ensure()}"  # the name the clients are set up with


def claude_code(home: Path) -> Callable[[int], tuple[list[str], dict]]:
    """`claude -p`, its defaults, pointed at the proxy."""
    claude = client_bin("claude")

    def run(port: int) -> tuple[list[str], dict]:
        env = quiet_env(home, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}",
                        ANTHROPIC_API_KEY="sk-local")  # fmt: skip
        return [claude, "-p", "say hi"], env

    return run


async def test_claude_code_runs_unchanged(client_model, tmp_path):
    client = claude_code(tmp_path / "home")
    exchanges, done = await recorded_run(client, tmp_path / "work", "--model", client_model)
    assert_all_2xx(exchanges, done)
    (first, *_) = posts(exchanges, "/v1/messages")
    body = first.json()
    assert first.headers.get("x-claude-code-session-id")
    assert len(body["tools"]) >= 20 and body["max_tokens"] >= 32000 and body["stream"]


async def test_claude_code_retries_with_less_output_after_the_context_error(
    client_model, tmp_path
):
    """With less context than it asks for, Claude Code reads Anthropic's
    context-limit wording and asks again with a smaller max_tokens."""
    client = claude_code(tmp_path / "home")
    exchanges, done = await recorded_run(
        client, tmp_path / "work", "--model", client_model, "--context-length", "65536"
    )
    sent = posts(exchanges, "/v1/messages")
    said = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
    assert [e.status for e in sent][:2] == [400, 200], ([e.status for e in sent], said)
    refused = json.loads(sent[0].response)["error"]["message"]
    assert refused.startswith("input length and `max_tokens` exceed context limit: ")
    assert sent[1].json()["max_tokens"] < sent[0].json()["max_tokens"]
    assert done.returncode == 0, said


CODEX_CONFIG = """model = "client-llama"
model_provider = "local"

[model_providers.local]
name = "local"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "LOCAL_API_KEY"
"""


async def test_codex_runs_unchanged(client_model, tmp_path):
    codex, config = client_bin("codex"), tmp_path / "home" / ".codex"

    def client(port: int) -> tuple[list[str], dict]:
        config.mkdir(parents=True)
        (config / "config.toml").write_text(CODEX_CONFIG.format(port=port))
        env = quiet_env(tmp_path / "home", CODEX_HOME=str(config), LOCAL_API_KEY="sk-local")
        return [codex, "exec", "--skip-git-repo-check", "say hi"], env

    exchanges, done = await recorded_run(client, tmp_path / "work", "--model", client_model)
    assert_all_2xx(exchanges, done)
    (first, *_) = posts(exchanges, "/v1/responses")
    body = first.json()
    assert body["prompt_cache_key"] and "include" in body
    assert {t["type"] for t in body["tools"]} >= {"function", "namespace", "web_search"}
    assert first.response.startswith(b"event: response.created")


AGENT = """
calls = []


@function_tool
def get_weather(city: str) -> str:
    "The weather in a city."
    calls.append(city)
    return "sunny, 21 C"


async def main(url, kind):
    model = sdk_model(url, kind, "client-llama")
    settings = ModelSettings(tool_choice="required", max_tokens=400)
    agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                  model=model, model_settings=settings)
    result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
    shaped = Agent(name="verdict", instructions="Answer.", tools=[get_weather], model=model,
                   model_settings=settings, output_type=Verdict)
    verdict = await Runner.run(shaped, "Is it ok?", max_turns=4)
    print(json.dumps({"calls": len(calls), "final": str(result.final_output)[:80],
                      "verdict": verdict.final_output.model_dump()}))
"""


@pytest.mark.parametrize("kind", ["responses", "chat"])
async def test_the_agents_sdk_runs_a_tool_loop(client_model, kind, tmp_path):
    """The Agents SDK's tool loop (a required call, then its final answer) and a
    structured answer (``output_type``) beside a required tool, on both models."""

    def client(port: int) -> tuple[list[str], dict]:
        return agents_sdk(AGENT, tmp_path, port, kind)

    exchanges, done = await recorded_run(client, tmp_path / "work", "--model", client_model)
    assert_all_2xx(exchanges, done)
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert out["calls"] >= 1 and out["verdict"]["ok"] in (True, False), out


SEES = """
import base64
import urllib.request
from typing import Literal


class Seen(BaseModel):  # a shaped answer: it ends by construction on a random model
    colour: Literal["red", "green", "blue", "black", "white", "grey", "yellow", "purple"]
    busy: bool


async def main(url, kind):
    model = sdk_model(url, kind, "vision")
    settings = ModelSettings(temperature=0, max_tokens=64)
    agent = Agent(name="eyes", instructions="Say what you see.", model=model,
                  model_settings=settings, output_type=Seen)
    answers = []
    for name in sys.argv[3:]:
        shown = "data:image/png;base64," + base64.b64encode(Path(name).read_bytes()).decode()
        asked = [{"role": "user", "content": [{"type": "input_image", "image_url": shown,
                                               "detail": "auto"},
                                              {"type": "input_text", "text": "What is this?"}]}]
        seen = (await Runner.run(agent, asked, max_turns=1)).final_output
        answers.append(seen.model_dump())
    print(json.dumps(answers))
    with urllib.request.urlopen(url + "/stats") as stats:  # the server's image figures
        print(json.dumps(json.load(stats)["images"]))
"""


@pytest.mark.parametrize("kind", ["responses", "chat"])
async def test_the_agents_sdk_sends_an_input_image_that_reaches_the_model(kind, tmp_path):
    """The Agents SDK sends screenshots as ``input_image`` items (as chat
    ``image_url`` parts on its chat model) to the tiny vision model, with a shaped
    answer: every request answered 2xx, each answer of the shape, and the server
    encoded the two screenshots (the first, sent again, found by its content)."""
    from test_vision import MODEL, png

    shots = []
    for seed in (31, 32, 31):
        shots.append(tmp_path / f"shot{len(shots)}.png")
        shots[-1].write_bytes(png(seed))
    vision = f"vision={GOLDENS / 'models' / MODEL}"

    def client(port: int) -> tuple[list[str], dict]:
        argv, env = agents_sdk(SEES, tmp_path, port, kind)
        return [*argv, *map(str, shots)], env

    exchanges, done = await recorded_run(client, tmp_path / "work", "--model", vision)
    assert_all_2xx(exchanges, done)
    sent = [e for e in exchanges if e.method == "POST"]
    assert len(sent) == 3 and all(b"data:image/png;base64," in e.body for e in sent)
    lines = done.stdout.decode().strip().splitlines()
    answers, images = json.loads(lines[-2]), json.loads(lines[-1])
    assert len(answers) == 3 and all(a["colour"] and "busy" in a for a in answers), answers
    assert images["encoded"] == 2, images
