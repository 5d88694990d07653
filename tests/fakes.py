"""A small fake backend for pure unit tests: a block-granular prefix cache and scripted replies.

It mimics what matters of vLLM: a prompt reuses the longest chain of full cached blocks
(never its own last token), and every full block it computes becomes cached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from compaction.backend import Generation, GenerationRequest
from compaction.errors import BackendError

Script = Callable[[GenerationRequest], tuple[str, str]]


def short_summary(request: GenerationRequest) -> tuple[str, str]:
    """A summary that states no salient token, so it passes the grounding check of any history."""
    return "A short summary of the conversation.", "stop"


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


# Options for tests of the model summaries alone: no pinned lines, no user words in the head.
PLAIN = {"pinned_share": 0.0, "user_words_tokens": 0}
