"""The scripted test model: an mlx-lm architecture whose next token follows a script
keyed by the conversation, so real agent clients run real multi-step loops.

It is a model like any other to the engine: its first cache, a plain ``KVCache``,
holds the token ids as its values (and each one's position as its key, so a row
whose keys a verify step's rollback moved is read back in order), so it
prefills, batches, joins, leaves, is cached and restored, and speculates through
the same paths as a trained model.
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

import contextlib
import hashlib
import itertools
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
# The engine's first image id (actors/models/vision.py IMAGE_BASE): an image's
# soft tokens read back as IMAGE (this file runs outside the package).
IMAGE_BASE = 1 << 30
IMAGE = "\uf000"


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    specials: list = field(default_factory=list)  # the tokens after the 256 bytes, in id order
    script: str = "script.json"
    dialect: str = "chatml"  # how the served template writes turns, and the model answers
    # A llama's config (hidden size, layers, heads...): a real transformer runs
    # beside the script over the same tokens, its output unused but computed, so
    # prefill and decode cost what such a model's do (benchmarks). None: no cost.
    body: dict | None = None
    embeds: int | None = None  # a vision checkpoint's: its embedding table's width


@dataclass(frozen=True)
class Dialect:
    """How one family's template writes a conversation, read back: where a
    message starts (``message``, a regex whose group 1, where it has one, names
    the role; else ``roles`` maps the marker), what ends one (``ends``), a tool
    result inside a message (``result``), and where an answer starts
    (``generation``, the generation prompt). Specials in the patterns are
    single characters by the time they are compiled (see :meth:`Script.pattern`)."""

    message: str
    ends: tuple
    generation: str
    result: str = ""
    roles: tuple = ()  # (marker, role) pairs for markers that are the role


ROLE_NAMES = {"ai": "assistant", "ipython": "tool", "observation": "tool"}
DIALECTS = {
    "chatml": Dialect(r"<|im_start|>([a-z_]*)\n?", ("<|im_end|>",), r"<|im_start|>assistant\n",
                      r"<tool_response>\n?(.*?)\n?</tool_response>"),
    "qwen3": Dialect(r"<|im_start|>([a-z_]*)\n?", ("<|im_end|>",),
                     r"<|im_start|>assistant\n(?:<think>\n\n</think>\n\n)?",
                     r"<tool_response>\n?(.*?)\n?</tool_response>"),
    "harmony": Dialect(r"<|start|>([^\ue000-\uefff]*?)(?:<|channel|>[^\ue000-\uefff]*)?"
                       r"<|message|>",
                       ("<|end|>", "<|call|>", "<|return|>"), r"<|start|>assistant"),
    "llama3": Dialect(r"<|start_header_id|>(\w+)<|end_header_id|>\n\n",
                      ("<|eot_id|>", "<|eom_id|>"),
                      r"<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "deepseek": Dialect(r"(<｜User｜>|<｜Assistant｜>|<｜tool▁output▁begin｜>"
                        r"|<｜tool▁output▁end｜>)",
                        ("<｜end▁of▁sentence｜>",),
                        r"<｜Assistant｜>(?:</think>|<think>)?|<｜tool▁output▁end｜>",
                        roles=(("<｜User｜>", "user"), ("<｜Assistant｜>", "assistant"),
                               ("<｜tool▁output▁begin｜>", "tool"),
                               ("<｜tool▁output▁end｜>", "assistant"))),
    "mistral": Dialect(r"([INST]|[/INST]|[TOOL_RESULTS]|[/TOOL_RESULTS]|[SYSTEM_PROMPT])",
                       ("</s>", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]"),
                       r"[/INST]|[/TOOL_RESULTS]",
                       roles=(("[INST]", "user"), ("[/INST]", "assistant"),
                              ("[TOOL_RESULTS]", "tool"), ("[/TOOL_RESULTS]", "assistant"),
                              ("[SYSTEM_PROMPT]", "system"))),
    "glm": Dialect(r"(<|system|>|<|user|>|<|assistant|>|<|observation|>)\n?", ("<|endoftext|>",),
                   r"<|assistant|>(?:\n<think></think>)?",
                   r"<tool_response>\n?(.*?)\n?</tool_response>",
                   roles=(("<|system|>", "system"), ("<|user|>", "user"),
                          ("<|assistant|>", "assistant"), ("<|observation|>", "tool"))),
    "kimi": Dialect(r"(?:<|im_system|>|<|im_user|>|<|im_assistant|>)(\w+)<|im_middle|>",
                    ("<|im_end|>",),
                    r"<|im_assistant|>assistant<|im_middle|>", r"## Return of \S*?(?:\\n|\n)(.*)"),
    "minimax": Dialect(r"]~b](\w+)\n", ("[e~[",), r"]~b]ai\n(?:<think>\n)?",
                       r"<response>(.*?)</response>"),
}  # fmt: skip
DIALECTS["qwen3_coder"] = DIALECTS["chatml"]  # the template writes turns as chatml does


@dataclass
class Conversation:
    """The rendered prompt before the answer, read back into turns: each
    ``(role, content)``, a tool result's role being ``"tool"``."""

    turns: list

    def last_result(self) -> str:
        results = [c for role, c in self.turns if role == "tool"]
        if not results:
            return ""
        text = results[-1].strip()
        if text.startswith('"'):  # templates that write a result as JSON text (Harmony, Llama 3)
            with contextlib.suppress(ValueError):
                text = json.loads(text)
        return str(text).strip().split("\n")[0][:200]

    def answered(self, when: str) -> int | None:
        """How many answers (runs of assistant messages) follow the first user
        message holding ``when``; None where none holds it."""
        for i, (role, content) in enumerate(self.turns):
            if role == "user" and when in content:
                later = [r for r, _ in self.turns[i:]]
                return sum(
                    a != "assistant" and b == "assistant" for a, b in itertools.pairwise(later)
                )
        return None


class Script:
    def __init__(self, args: ModelArgs, rules: dict):
        self.args = args
        self.rules = rules.get("rules", [])
        self.default = rules.get("default", {"text": "ok"})
        self.dialect = DIALECTS[args.dialect]
        # Each special is one private-use character in the text the script reads.
        self.chars = {tok: chr(0xE000 + i) for i, tok in enumerate(args.specials)}
        self.specials = re.compile("|".join(map(re.escape, sorted(self.chars, key=len)[::-1])))
        self.message = self.pattern(self.dialect.message)
        self.generation = self.pattern(self.dialect.generation)
        self.ends = [self.chars.get(e, e) for e in self.dialect.ends]
        self.result = re.compile(self.dialect.result, re.S) if self.dialect.result else None
        self.roles = {self.chars.get(m, m): r for m, r in self.dialect.roles}
        ends = [args.specials.index(e) + 256 for e in self.dialect.ends if e in args.specials]
        self.end = ends[0]
        self.plans: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def pattern(self, regex: str) -> re.Pattern:
        return re.compile(
            self.specials.sub(lambda m: re.escape(self.chars[m.group()]), regex), re.S
        )

    def text(self, ids: np.ndarray) -> str:
        """One character per id: bytes as latin-1, specials as private-use, an
        image's ids as ``IMAGE``."""
        wide = np.where(ids >= 256, ids - 256 + 0xE000, ids)
        wide = np.where(ids >= IMAGE_BASE, ord(IMAGE), wide).astype("<u4")
        return wide.tobytes().decode("utf-32-le")

    def plain(self, text: str) -> str:
        """The UTF-8 text a stretch of :meth:`text` stands for (an image as
        ``[image]``)."""
        out, specials = [], {c: t for t, c in self.chars.items()}
        specials[IMAGE] = "[image]"
        for part in re.split(f"([\ue000-\uefff]|{IMAGE}+)", text):
            part = part[:1] if part.startswith(IMAGE) else part
            out.append(specials.get(part) or part.encode("latin-1").decode("utf-8", "replace"))
        return "".join(out)

    def read(self, text: str) -> Conversation:
        marks = list(self.message.finditer(text))
        turns = []
        for i, mark in enumerate(marks):
            stop = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            content = text[mark.end() : stop]
            for end in self.ends:
                content = content.split(end)[0]
            role = mark.group(1) if mark.re.groups else mark.group()
            role = self.roles.get(role) or ROLE_NAMES.get(role) or role.split()[0] if role else ""
            role = "tool" if role.startswith("functions.") else role
            content = self.plain(content)
            found = self.result.search(content) if self.result else None
            if found and role in ("user", "tool"):
                role, content = "tool", found.group(1)
            if role != "assistant" or content.strip():  # (an empty one: a marker between
                turns.append((role, content))  # two results, where the answer goes on)
        return Conversation(turns)

    def answer(self, conversation: Conversation, opened: bool) -> str:
        """The first rule whose ``when`` a user message holds answers with the
        turn the conversation is at (the last one once past them all), in the
        dialect's own markup, its end token last."""
        turn = self.default
        for rule in self.rules:
            done = conversation.answered(rule["when"])
            if done is not None:
                turn = rule["turns"][min(done, len(rule["turns"]) - 1)]
                break
        text = turn.get("text", "").replace("{last_result}", conversation.last_result())
        return WRITERS[self.args.dialect](turn.get("reasoning", ""), text, turn.get("calls", []),
                                          opened)  # fmt: skip

    def ids(self, answer: str) -> np.ndarray:
        out, last = [], 0
        for m in self.specials.finditer(answer):
            out.extend(answer[last : m.start()].encode())
            out.append(256 + self.args.specials.index(m.group()))
            last = m.end()
        out.extend(answer[last:].encode())
        return np.array(out, np.int64)

    def plan(self, prompt: np.ndarray, header: str) -> np.ndarray:
        """The ids of the whole answer (end token last) to the conversation
        ``prompt`` (ending where the generation prompt ``header`` starts)."""
        key = hashlib.sha1(prompt.tobytes()).digest() + header.encode("utf-8", "replace")
        if key not in self.plans:
            opened = self.chars.get("<think>", "\0") in header
            said = self.answer(self.read(self.text(prompt)), opened)
            self.plans[key] = self.ids(said)
            while len(self.plans) > 64:
                self.plans.popitem(last=False)
        self.plans.move_to_end(key)
        return self.plans[key]

    def heads(self, text: str, ends: np.ndarray) -> tuple[list, np.ndarray]:
        """The generation prompts in ``text`` as (start, end, text), and for each
        query the index of the last one it sees whole. A query that sees only the
        start of one (its optional tail, e.g. GLM's ``<think></think>``, matched
        over tokens after the query: a draft being verified) gets that one as
        matched on what it sees."""
        found = [(h.start(), h.end(), h.group()) for h in self.generation.finditer(text)]
        last = np.searchsorted([h[1] for h in found], ends + 1, side="right") - 1
        for q, e in enumerate(ends.tolist()):
            nxt = int(last[q]) + 1
            if nxt < len(found) and found[nxt][0] <= e:
                short = self.generation.match(text, found[nxt][0], e + 1)
                if short is not None:
                    found.append((short.start(), short.end(), short.group()))
                    last[q] = len(found) - 1
        return found, last

    def next_all(self, row: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The next token after ``row[: end + 1]`` for each of ``ends``: inside an
        answer, its next token; otherwise the end token. Queries are grouped by
        the last generation prompt before them; the earliest of the last few whose
        answer is what follows it is the one being written (Harmony writes
        ``<|start|>assistant`` inside an answer)."""
        out = np.full(len(ends), self.end, np.int64)
        heads, last = self.heads(self.text(row), ends)
        for i in np.unique(last[last >= 0]):
            queries = np.flatnonzero(last == i)
            e = int(ends[queries].min())  # later queries may read drafts, right or wrong
            head = heads[i]
            earlier = [h for h in heads if h[1] <= head[0]][-3:]  # an answer holds a few at most
            found = None
            for start, end, group in reversed([*earlier, head]):
                plan = self.plan(row[:start], group)
                said = row[end : e + 1]
                if len(said) < len(plan) and np.array_equal(plan[: len(said)], said):
                    found = (plan, end)
            if found is None:
                continue
            plan, start = found
            written = row[start : int(ends[queries].max()) + 1][: len(plan)]
            wrong = np.flatnonzero(written != plan[: len(written)])
            right = wrong[0] if len(wrong) else len(written)  # the answer as written, so far
            said = ends[queries] + 1 - start
            ok = (said >= 0) & (said < len(plan)) & (said <= right)
            out[queries[ok]] = plan[said[ok]]
        return out


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _chatml(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    return (
        think
        + text
        + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
        + "<|im_end|>"
    )


def _xml(call: dict, each: str) -> str:
    """A call's arguments in XML, each as ``each`` writes it (``{k}``, ``{v}``)."""
    return "".join(each.format(k=k, v=_value(v)) for k, v in call["arguments"].items())


def _qwen3_coder(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    each = "<parameter={k}>\n{v}\n</parameter>\n"
    blocks = [f"<tool_call>\n<function={c['name']}>\n{_xml(c, each)}</function>\n</tool_call>"
              for c in calls]  # fmt: skip
    return think + text + ("\n\n" if text and calls else "") + "\n".join(blocks) + "<|im_end|>"


def _glm(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = f"\n<think>{reasoning}</think>" if reasoning else ""
    each = "<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
    blocks = [f"<tool_call>{c['name']}\n{_xml(c, each)}</tool_call>" for c in calls]
    end = "<|observation|>" if calls else "<|user|>"
    return think + ("\n" + text if text else "") + "".join("\n" + b for b in blocks) + end


def _minimax(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = (
        (f"{reasoning}\n</think>\n\n" if opened else f"<think>\n{reasoning}\n</think>\n\n")
        if reasoning
        else ("</think>\n\n" if opened else "")
    )
    each = '<parameter name="{k}">{v}</parameter>\n'
    invokes = "".join(f'<invoke name="{c["name"]}">\n{_xml(c, each)}</invoke>\n' for c in calls)
    block = f"\n<minimax:tool_call>\n{invokes}</minimax:tool_call>" if calls else ""
    return think + text + block + "[e~["


def _kimi(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = f"<think>{reasoning}</think>" if reasoning else ""
    block = "".join(
        f"<|tool_call_begin|>functions.{c['name']}:{i}<|tool_call_argument_begin|>"
        f"{json.dumps(c['arguments'])}<|tool_call_end|>"
        for i, c in enumerate(calls)
    )
    block = f"<|tool_calls_section_begin|>{block}<|tool_calls_section_end|>" if calls else ""
    return think + text + block + "<|im_end|>"


def _deepseek(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = f"{reasoning}</think>" if opened else ""
    block = "".join(
        f"<｜tool▁call▁begin｜>{c['name']}<｜tool▁sep｜>{json.dumps(c['arguments'])}"
        "<｜tool▁call▁end｜>"
        for c in calls
    )
    block = f"<｜tool▁calls▁begin｜>{block}<｜tool▁calls▁end｜>" if calls else ""
    return think + text + block + "<｜end▁of▁sentence｜>"


def _mistral(reasoning: str, text: str, calls: list, opened: bool) -> str:
    think = f"[THINK]{reasoning}[/THINK]" if reasoning else ""
    block = "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)
    return think + text + block + "</s>"


def _llama3(reasoning: str, text: str, calls: list, opened: bool) -> str:
    if calls:
        return (
            "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
            + "<|eot_id|>"
        )
    return text + "<|eot_id|>"


def _harmony(reasoning: str, text: str, calls: list, opened: bool) -> str:
    """A call ends a Harmony answer (``<|call|>`` is an end token): one a turn."""
    out = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
    if calls:
        if text:
            out += f"<|channel|>commentary<|message|>{text}<|end|><|start|>assistant"
        c = calls[0]
        return (
            out + f" to=functions.{c['name']}<|channel|>commentary json<|message|>"
            f"{json.dumps(c['arguments'])}<|call|>"
        )
    return out + f"<|channel|>final<|message|>{text}<|return|>"


WRITERS = {"chatml": _chatml, "qwen3": _chatml, "qwen3_coder": _qwen3_coder, "glm": _glm,
           "minimax": _minimax, "kimi": _kimi, "deepseek": _deepseek, "mistral": _mistral,
           "llama3": _llama3, "harmony": _harmony}  # fmt: skip


EMBEDS = "language_model.model.embed_tokens.weight"


class _Embeds(nn.Module):
    """Where a Gemma 3 checkpoint keeps its embedding table (``EMBEDS``)."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, width)


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
        if args.embeds is not None:  # a vision checkpoint's embedding table (sanitize)
            self.language_model = _Embeds(args.vocab_size, args.embeds)

    def sanitize(self, weights: dict) -> dict:
        """Its own weights: a vision checkpoint's directory (``make_scripted_model
        --vision``) holds a real one's, of which only the embedding table is
        kept (the image side reads it to merge a prompt's embeddings)."""
        own = {k: v for k, v in weights.items() if k == "unit" or k.startswith("body.")}
        if self.args.embeds is not None:
            own[EMBEDS] = weights[EMBEDS]
        return {"unit": mx.ones((1,)), **own}

    def make_cache(self) -> list:
        """One plain cache for the ids, one per layer of the body."""
        return [KVCache() for _ in range(1 + (len(self.body.layers) if self.args.body else 0))]

    def __call__(self, inputs: mx.array, cache: Any = None, **_: Any) -> mx.array:
        cache = cache or self.make_cache()
        B, L = inputs.shape
        ids = (inputs.astype(mx.float32) * self.unit)[:, None, :, None]
        # Each id's position beside it (its key, as a real model's rotated key
        # carries it): a verify step's rollback moves a row's first keys to free
        # slots (attention does not care where a key sits), and the script reads
        # the row back in its order.
        offset = cache[0].offset
        start = offset[:, None] if isinstance(offset, mx.array) else mx.array([[offset]])
        where = mx.broadcast_to(start + mx.arange(L)[None], (B, L)).astype(mx.float32)
        keys, values = cache[0].update_and_fetch(where[:, None, :, None], ids)
        cost = self.body(inputs, cache=cache[1:]).sum() * 0 if self.args.body else 0
        held = np.array(values[:, 0, :, 0]).astype(np.int64)
        at = np.array(keys[:, 0, :, 0])
        T = held.shape[1]
        # What attention would see: a row's keys from its left padding on (the
        # batch cache's record of where each row starts; what its mask masks),
        # each query up to its own position (causal).
        pads = getattr(cache[0], "left_padding", None)
        firsts = np.array(pads).astype(np.int64) if pads is not None else np.zeros(B, np.int64)
        logits = np.zeros((B, L, self.args.vocab_size), np.float32)
        for b in range(B):
            ends = (T - L - firsts[b]) + np.arange(L)
            row, order = held[b, firsts[b] :], at[b, firsts[b] :]
            if np.any(np.diff(order) < 0):
                row = row[np.argsort(order, kind="stable")]
            logits[b, np.arange(L), self.script.next_all(row, ends)] = SURE
        return mx.array(logits) + cost  # the body is computed with the logits
