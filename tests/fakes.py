"""A small fake backend for pure unit tests: a block-granular prefix cache and scripted replies.

It mimics what matters of vLLM: a prompt reuses the longest chain of full cached blocks
(never its own last token), and every full block it computes becomes cached.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from compaction.backend import Generation, GenerationRequest
from compaction.errors import BackendError

Script = Callable[[GenerationRequest], tuple[str, str]]


def short_summary(request: GenerationRequest) -> tuple[str, str]:
    """A summary that states no salient token, so it passes the grounding check of any history."""
    return "They talked for a while and agreed on the next steps.", "stop"


class FakeBackend:
    def __init__(self, block_size: int = 16, script: Script = short_summary, fail_on: set[int] | None = None):
        self.block_size = block_size
        self.script = script
        self.blocks: set[tuple[int, ...]] = set()
        self.requests: list[GenerationRequest] = []
        self.fail_on = fail_on or set()

    def cached_tokens(self, ids: tuple[int, ...]) -> int:
        cached = 0
        for end in range(self.block_size, len(ids), self.block_size):
            if ids[:end] not in self.blocks:
                break
            cached = end
        return cached

    async def generate(self, request: GenerationRequest) -> Generation:
        index = len(self.requests)
        self.requests.append(request)
        await asyncio.sleep(0)
        if index in self.fail_on:
            raise BackendError(f"request {index} failed")
        ids = request.prompt_token_ids
        cached = self.cached_tokens(ids)
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            self.blocks.add(ids[:end])
        text, finish = self.script(request)
        return Generation(
            text=text,
            output_tokens=len(text.split()),
            prompt_tokens=len(ids),
            cached_prompt_tokens=cached,
            finish_reason=finish,
            latency_s=0.0,
            replica="fake",
        )


class HoldingBackend(FakeBackend):
    """A FakeBackend that holds the requests `holds` picks (given the requests before) until they are cancelled,
    noting their ids in `given_up`; `all_held` is set once `expect` of them are held."""

    def __init__(self, holds: Callable[[GenerationRequest, list[GenerationRequest]], bool], **kw: Any) -> None:
        super().__init__(**kw)
        self.holds = holds
        self.expect = 0
        self.held = 0
        self.all_held = asyncio.Event()
        self.given_up: list[str] = []

    async def generate(self, request: GenerationRequest) -> Generation:
        if not self.holds(request, self.requests):
            return await super().generate(request)
        self.requests.append(request)
        self.held += 1
        if self.held >= self.expect:
            self.all_held.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.given_up.append(request.request_id)
            raise
        raise AssertionError("a held request is only ever given up")


# Options for tests of the model summaries alone: no pinned lines, no user words or ledger in the head, no clearing.
PLAIN = {"pinned_share": 0.0, "user_words_tokens": 0, "clearing": "off", "ledger_tokens": 0}


class ChatMLTokenizer:
    """A small ChatML tokenizer and chat template (SmolLM2's shape) for pure tests that need no model files.

    Words, runs of spaces and single punctuation marks are tokens; `<|im_start|>`, `<|im_end|>` and
    `<|endoftext|>` are control tokens wherever they are spelled, unless the text is tokenised as text.
    Ids come from a vocabulary that grows as text is seen, so they are stable within a test session.
    """

    SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    _PIECE = re.compile(r" ?\w+| ?[^\w\s]|\s+")

    def __init__(self) -> None:
        self._ids: dict[str, int] = {s: i for i, s in enumerate(self.SPECIALS)}
        self._texts: list[str] = list(self.SPECIALS)
        self._special = re.compile("|".join(re.escape(s) for s in self.SPECIALS))

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, tools: Any = None) -> str:
        head = "" if messages and messages[0]["role"] == "system" else self._turn("system", self.DEFAULT_SYSTEM)
        body = "".join(self._turn(m["role"], m["content"]) for m in messages)
        return head + body + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    @staticmethod
    def _turn(role: str, content: str) -> str:
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"

    def _id(self, piece: str) -> int:
        if piece not in self._ids:
            self._ids[piece] = len(self._texts)
            self._texts.append(piece)
        return self._ids[piece]

    def encode_with_offsets(self, text: str, as_text: bool = False) -> tuple[list[int], list[int]]:
        ids, offsets, at = [], [], 0
        spans = [] if as_text else [(m.start(), m.end()) for m in self._special.finditer(text)]
        for start, end in [*spans, (len(text), len(text))]:
            for piece in self._PIECE.finditer(text, at, start):
                ids.append(self._id(piece.group()))
                offsets.append(piece.start())
            if end > start:
                ids.append(self._ids[text[start:end]])
                offsets.append(start)
            at = end
        return ids, offsets

    @property
    def control_token_ids(self) -> frozenset[int]:
        return frozenset(range(len(self.SPECIALS)))

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self.SPECIALS

    @property
    def max_token_chars(self) -> int:
        return 1 << 20  # a word is one token however long: no tighter bound

    def preamble(self, first_role: str) -> str:
        return "" if first_role == "system" else self._turn("system", self.DEFAULT_SYSTEM)

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self._texts[i] for i in token_ids if i >= len(self.SPECIALS))

    def user_turn(self, content: str) -> str:
        return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"

    def chat_prompt_tokens(self, views: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
        plain = [{"role": v["role"], "content": v.get("content") or ""} for v in views]
        listed = len(self.encode(json.dumps(list(tools)))) if tools else 0  # the tool list, in the system turn
        calls = sum(len(self.encode(json.dumps(v.get("tool_calls")))) for v in views if v.get("tool_calls"))
        return len(self.encode(self.render(plain, add_generation_prompt=True))) + listed + calls

    @property
    def end_of_turn(self) -> str:
        return "<|im_end|>\n"
