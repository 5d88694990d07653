"""Model engines for sweeps: one vLLM engine per model, hosted in a Ray actor that cells share.

Starting an engine costs ~30 s and its KV cache on the CPU, so the sweep starts one per model
and every cell task reaches it through `ActorBackend`. The actor is async: the chunk prompts of
one compaction arrive concurrently and the engine batches them.
"""

from __future__ import annotations

from typing import Any

from compaction.backend import Generation, GenerationRequest


class EngineHost:
    """A plain class around `VLLMBackend`; `ray.remote(EngineHost)` makes it the engine actor."""

    def __init__(self, model_path: str, max_model_len: int, kv_cache_gib: int) -> None:
        from serving.backends import VLLMBackend

        self.backend = VLLMBackend.start(model_path, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib)

    def limits(self) -> tuple[int, int]:
        """(context window, prefix-cache block size) of the running engine."""
        return self.backend.max_model_len, self.backend.block_size

    async def generate(self, request: GenerationRequest) -> Generation:
        return await self.backend.generate(request)

    async def reset_prefix_cache(self) -> None:
        await self.backend.reset_prefix_cache()

    def shutdown(self) -> None:
        self.backend.shutdown()


class ActorBackend:
    """`Backend` over an engine actor handle (picklable, so cell tasks receive it as an argument)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def generate(self, request: GenerationRequest) -> Generation:
        result: Generation = await self.actor.generate.remote(request)
        return result

    async def reset_prefix_cache(self) -> None:
        await self.actor.reset_prefix_cache.remote()
