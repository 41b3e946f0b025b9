"""The scripted test model: an mlx-lm architecture whose next token follows a script
keyed by the conversation, so real agent clients run real multi-step loops.

It is a model like any other to the engine: its first cache, a plain ``KVCache``,
holds the token ids as its values, so it prefills, batches, joins, leaves, is
cached and restored, and speculates through the same paths as a trained model.
What it reads is what attention would: a row's keys from its left padding on
(where the batch cache records each row's start, as its mask does: padding and
other rows' leftovers stay out), each query up to its own position; every query
gets its scripted logits, so a verify step or a padded prefill reads them where
it needs them. From those ids it rebuilds the rendered conversation (chatml,
byte-level: ids 0-255 are bytes, the specials follow), finds the first script
rule whose ``when`` a user message holds, and answers the turn the conversation
is at (how many assistant turns follow that message): its text and its calls,
written in the served tool format, then the end token. The answer's next byte
gets all the probability; the rest share none.

The directory carries this file as ``model.py`` (``"model_file"`` in its config:
serve it with ``--trust-remote-code``) and the script as ``script.json``::

    {"rules": [{"when": "fan out", "turns": [
        {"calls": [{"name": "Agent", "arguments": {"prompt": "Read a.txt", ...}}]},
        {"text": "Done: {last_result}"}]}],
     "default": {"text": "ok"}}

``{last_result}`` in a text stands for the first line of the conversation's last
tool result. A conversation no rule matches gets ``default``.

No ``from __future__ import annotations``: mlx-lm runs this file as a module it
does not register, and dataclasses then cannot resolve string annotations.
"""

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import KVCache

HERE = Path(__file__).resolve().parent
SURE = 100.0  # the scripted token's logit; every other token's is 0


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    specials: list = field(default_factory=list)  # the tokens after the 256 bytes, in id order
    script: str = "script.json"
    # chatml, as the served template writes it
    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    call: str = "<tool_call>\n{call}\n</tool_call>"
    result_open: str = "<tool_response>\n"
    result_close: str = "\n</tool_response>"
    # A llama's config (hidden size, layers, heads...): a real transformer runs
    # beside the script over the same tokens, its output unused but computed, so
    # prefill and decode cost what such a model's do (benchmarks). None: no cost.
    body: dict | None = None


@dataclass
class Conversation:
    """The rendered prompt before the answer, read back into turns: each
    ``(role, content)``, a tool result's role being ``"tool"``."""

    turns: list

    def last_result(self) -> bytes:
        results = [c for role, c in self.turns if role == b"tool"]
        return results[-1].strip().split(b"\n")[0][:200] if results else b""

    def answered(self, when: bytes) -> int | None:
        """How many assistant turns follow the first user message holding
        ``when``; None where none holds it."""
        for i, (role, content) in enumerate(self.turns):
            if role == b"user" and when in content:
                return sum(r == b"assistant" for r, _ in self.turns[i + 1 :])
        return None


class Script:
    def __init__(self, args: ModelArgs, rules: dict):
        self.args = args
        self.rules = rules.get("rules", [])
        self.default = rules.get("default", {"text": "ok"})
        self.start = args.specials.index(args.turn_start) + 256
        self.end = args.specials.index(args.turn_end) + 256
        self.plans: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def decode(self, ids: np.ndarray) -> bytes:
        out, last = [], 0
        for i in np.flatnonzero(ids >= 256):
            out.append(ids[last:i].astype(np.uint8).tobytes())
            out.append(self.args.specials[int(ids[i]) - 256].encode())
            last = i + 1
        out.append(ids[last:].astype(np.uint8).tobytes())
        return b"".join(out)

    def read(self, prompt: bytes) -> Conversation:
        start, end = self.args.turn_start.encode(), self.args.turn_end.encode()
        opened, closed = self.args.result_open.encode(), self.args.result_close.encode()
        turns = []
        for chunk in prompt.split(start)[1:]:
            # The role, then a newline that a template's ``{%-`` may have eaten.
            role = re.match(rb"[a-z_]*", chunk).group()
            content = chunk[len(role) :].removeprefix(b"\n").split(end)[0]
            if role == b"user" and opened in content:
                role, content = b"tool", content.split(opened)[-1].split(closed)[0]
            turns.append((role, content))
        return Conversation(turns)

    def answer(self, conversation: Conversation) -> bytes:
        """The first rule whose ``when`` a user message holds answers with the
        turn the conversation is at (the last one once past them all)."""
        turn = self.default
        for rule in self.rules:
            done = conversation.answered(rule["when"].encode())
            if done is not None:
                turn = rule["turns"][min(done, len(rule["turns"]) - 1)]
                break
        result = conversation.last_result().decode(errors="replace")
        text = turn.get("text", "").replace("{last_result}", result)
        calls = [self.args.call.replace("{call}", json.dumps(c)) for c in turn.get("calls", [])]
        return (text + "".join(calls)).encode()  # as the template joins them

    def plan(self, prompt: np.ndarray) -> np.ndarray:
        """The ids of the whole answer (end token last) to the conversation
        ``prompt`` ends in, from the last turn start on."""
        key = hashlib.sha1(prompt.tobytes()).digest()
        if key not in self.plans:
            said = np.frombuffer(self.answer(self.read(self.decode(prompt))), np.uint8)
            self.plans[key] = np.append(said.astype(np.int64), self.end)
            while len(self.plans) > 64:
                self.plans.popitem(last=False)
        self.plans.move_to_end(key)
        return self.plans[key]

    def next_all(self, row: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The next token after ``row[: end + 1]`` for each of ``ends``: where
        the last turn there is an open assistant turn, the answer's next byte;
        otherwise the end token. One plan per turn the queries are in."""
        out = np.full(len(ends), self.end, np.int64)
        starts = np.flatnonzero(row == self.start)
        header = np.frombuffer(b"assistant\n", np.uint8)
        last = np.searchsorted(starts, ends, side="right") - 1
        for i in np.unique(last[last >= 0]):
            s = starts[i]
            if not np.array_equal(row[s + 1 : s + 1 + len(header)], header):
                continue
            plan = self.plan(row[:s])
            queries = np.flatnonzero(last == i)
            said = ends[queries] - s - len(header)  # answer tokens already there
            ok = (said >= 0) & (said < len(plan))
            out[queries[ok]] = plan[said[ok]]
        return out


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.unit = mx.ones((1,))  # a weight, so the directory always has a safetensors file
        if args.body is not None:
            body = {"vocab_size": args.vocab_size, **args.body}
            self.body = llama.LlamaModel(llama.ModelArgs.from_dict(body))
        self.script = Script(args, json.loads((HERE / args.script).read_text()))

    def make_cache(self) -> list:
        """One plain cache for the ids, one per layer of the body."""
        return [KVCache() for _ in range(1 + (len(self.body.layers) if self.args.body else 0))]

    def __call__(self, inputs: mx.array, cache: Any = None, **_: Any) -> mx.array:
        cache = cache or self.make_cache()
        B, L = inputs.shape
        ids = (inputs.astype(mx.float32) * self.unit)[:, None, :, None]
        _, values = cache[0].update_and_fetch(ids, ids)
        cost = self.body(inputs, cache=cache[1:]).sum() * 0 if self.args.body else 0
        held = np.array(values[:, 0, :, 0]).astype(np.int64)
        T = held.shape[1]
        # What attention would see: a row's keys from its left padding on (the
        # batch cache's record of where each row starts; what its mask masks),
        # each query up to its own position (causal).
        pads = getattr(cache[0], "left_padding", None)
        firsts = np.array(pads).astype(np.int64) if pads is not None else np.zeros(B, np.int64)
        logits = np.zeros((B, L, self.args.vocab_size), np.float32)
        for b in range(B):
            ends = (T - L - firsts[b]) + np.arange(L)
            logits[b, np.arange(L), self.script.next_all(held[b, firsts[b] :], ends)] = SURE
        return mx.array(logits) + cost  # the body is computed with the logits
