"""The narrow protocol between the core and a model: generate from token ids.

Implementations: `serving.backends.VLLMBackend` (in-process vLLM engine),
`serving.backends.OpenAIBackend` (any OpenAI-compatible endpoint: vLLM, Ray Serve LLM), and
the Ray Serve replica-routed backend of the coordinator. Tests use a small fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete, already in token ids (never re-tokenised by the backend)."""

    prompt_token_ids: tuple[int, ...]  # exact prompt; prefix reuse depends on these ids
    max_tokens: int  # output budget
    min_tokens: int = 0  # > 0 forces a decode volume (matched-decode benchmarks)
    temperature: float = 0.0  # 0 = greedy, so reruns of a compaction are reproducible
    repetition_penalty: float = 1.0  # raised on the retry of a runaway summary
    request_id: str = ""  # for engine logs and cancellation
    routing_key: str | None = None  # placement hint (a replica id or a session id); backends may ignore it
    priority: int = 0  # engine scheduling priority, lower first (compaction.pacing: AGENT, BACKGROUND)
    cache_salt: str | None = None  # prefix-cache namespace on the engine (a tenant's); None: the shared cache
    tag: str | None = None  # names it to the engine, so a later request's `raises` can raise its priority
    raises: tuple[str, ...] = ()  # the engine runs its requests with these tags at this one's priority from now on


@dataclass(frozen=True)
class Generation:
    """What came back, with the engine's own accounting of prompt-cache use."""

    text: str
    output_tokens: int  # tokens generated
    prompt_tokens: int  # tokens in the prompt
    cached_prompt_tokens: int  # prompt tokens the engine served from its prefix cache
    finish_reason: str  # "stop" (EOS/stop string) or "length" (hit max_tokens)
    latency_s: float  # wall time of this request, queueing included
    replica: str | None = None  # which replica served it, where the backend knows
    failovers: int = 0  # times the request was moved to another replica after a failure

    @property
    def computed_prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens


@runtime_checkable
class Backend(Protocol):
    """A model endpoint. Raises `compaction.errors.BackendError` when it cannot answer."""

    async def generate(self, request: GenerationRequest) -> Generation: ...
