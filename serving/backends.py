"""Real implementations of `compaction.backend.Backend`.

- `VLLMBackend`: an in-process vLLM engine (AsyncLLM) with prefix caching; prompts go in as
  token ids and the engine reports `num_cached_tokens` per request.
- `OpenAIBackend`: any OpenAI-compatible `/v1/completions` endpoint (vLLM's server, Ray Serve
  LLM). The prompt is a token-id list; cached tokens come from `usage.prompt_tokens_details`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from compaction.backend import Generation, GenerationRequest
from compaction.errors import BackendError, InvalidInput, Overloaded
from compaction.pacing import CPU_RULE, engine_args
from serving.cpu import CPU_ENGINE_ENV, cpu_dtype
from serving.models import CpuBinding, yielding_engine_args
from serving.tenants import client_headers


class VLLMBackend:
    """An in-process vLLM engine. Create it under `if __name__ == "__main__":` (vLLM spawns a process)."""

    def __init__(self, engine: Any, name: str = "local") -> None:
        self.engine = engine
        self.name = name

    @classmethod
    def start(
        cls,
        model_path: str | Path,
        *,
        max_model_len: int = 8192,
        kv_cache_gib: int = 2,
        enforce_eager: bool = True,
        cpu_binding: CpuBinding = "cores",
        cpu_threads: int | None = None,
        **engine_kwargs: Any,
    ) -> VLLMBackend:
        """Start an engine with prefix caching on and background requests yielding to the agent's
        (`serving.scheduler`, `compaction.pacing.CPU_RULE`). On the CPU the KV cache size comes from the environment
        (VLLM_CPU_KVCACHE_SPACE, set to `kv_cache_gib` if unset) unless `kv_cache_memory_bytes=` is passed.

        On the CPU the engine computes where a model replica alone on its host would (`serving.placement`):
        `cpu_threads` of this process's cores, all of them by default, unless VLLM_CPU_OMP_THREADS_BIND is set.
        vLLM's own `auto` keeps one core for its scheduler: on a 2-core host that costs about a third of the prefill
        rate (docs/placement.md has the side-by-side figures).

        The cache block size is the engine's choice (128 tokens on vLLM-CPU, 16 on CUDA) unless
        `block_size=` is passed; read it back from `block_size`.
        """
        if "kv_cache_memory_bytes" not in engine_kwargs:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        for name, value in {"HF_HUB_OFFLINE": "1", **CPU_ENGINE_ENV}.items():
            os.environ.setdefault(name, value)  # the engine's processes inherit them
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from serving.placement import BIND_ENV, bind_value

        os.environ.setdefault(BIND_ENV, bind_value(cpu_binding, 0, cpu_threads, 1, sorted(os.sched_getaffinity(0))))

        hushed = logging.getLogger("vllm").getEffectiveLevel() >= logging.ERROR  # serving.local.hush: no load bar
        defaults = {"dtype": cpu_dtype(), "use_tqdm_on_load": not hushed, **yielding_engine_args("cpu", CPU_RULE)}
        args = AsyncEngineArgs(
            model=str(model_path),
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager,
            **(defaults | engine_kwargs),
        )
        backend = cls(AsyncLLM.from_engine_args(args))
        backend.end_with_this_process()
        return backend

    def end_with_this_process(self) -> None:
        """Stop the engine's processes when this one exits, a SIGTERM (`kill`, a stopped job) included.

        vLLM runs the engine in a child process that a SIGTERM to this one would otherwise orphan,
        holding its memory. A SIGTERM becomes an ordinary exit here, so `finally` blocks and atexit
        run, unless the program (Ray's workers, for one) already handles the signal itself.
        """
        atexit.register(self.shutdown)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    @property
    def block_size(self) -> int:
        """Tokens per prefix-cache block: reuse stops at a block border."""
        return int(self.engine.vllm_config.cache_config.block_size)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.vllm_config.model_config.max_model_len)

    async def generate(self, request: GenerationRequest) -> Generation:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            max_tokens=request.max_tokens,
            min_tokens=request.min_tokens,
            temperature=request.temperature,
            repetition_penalty=request.repetition_penalty,
            extra_args=engine_args(request) or None,
        )
        began = time.perf_counter()
        final = None
        request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:8]}"
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            async for out in self.engine.generate(prompt, params, request_id=request_id, priority=request.priority):
                final = out
        except ValueError as exc:  # vLLM rejects prompts it cannot take (too long, bad ids)
            raise InvalidInput("prompt", str(exc)) from exc
        except Exception as exc:
            raise BackendError(f"vLLM engine failed on {request_id}: {exc}") from exc
        if final is None or not final.outputs:
            raise BackendError(f"vLLM engine returned no output for {request_id}")
        completion = final.outputs[0]
        return Generation(
            text=completion.text,
            output_tokens=len(completion.token_ids),
            prompt_tokens=len(request.prompt_token_ids),
            cached_prompt_tokens=final.num_cached_tokens or 0,
            finish_reason=completion.finish_reason or "stop",
            latency_s=time.perf_counter() - began,
            replica=self.name,
        )

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine process now (not at interpreter exit, when vLLM's teardown misfires)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class OpenAIBackend:
    """An OpenAI-compatible completions endpoint that accepts token-id prompts."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else client_headers()
        self.model = model
        self.client = client or httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def generate(self, request: GenerationRequest) -> Generation:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
        }
        if request.min_tokens:
            body["min_tokens"] = request.min_tokens
        if request.repetition_penalty != 1.0:
            body["repetition_penalty"] = request.repetition_penalty
        if request.priority:  # a server without priority scheduling refuses any other than 0
            body["priority"] = request.priority
        if extra := engine_args(request):
            body["vllm_xargs"] = extra
        headers = {"x-session-id": request.routing_key} if request.routing_key else {}
        began = time.perf_counter()
        try:
            response = await self.client.post("/v1/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise BackendError(f"completions endpoint unreachable: {exc!r}") from exc
        if response.status_code in (429, 503):
            retry = float(response.headers.get("retry-after", "1") or 1)
            raise Overloaded(f"completions endpoint busy ({response.status_code})", retry)
        if response.status_code >= 400:
            raise BackendError(f"completions endpoint answered {response.status_code}: {response.text[:300]}")
        return parse_completion(response.json(), len(request.prompt_token_ids), time.perf_counter() - began)

    async def aclose(self) -> None:
        await self.client.aclose()


def parse_completion(data: dict[str, Any], prompt_len: int, latency_s: float) -> Generation:
    """A `/v1/completions` response body as a Generation."""
    try:
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Generation(
            text=choice.get("text") or "",
            output_tokens=int(usage.get("completion_tokens", 0)),
            prompt_tokens=int(usage.get("prompt_tokens", prompt_len)),
            cached_prompt_tokens=int(details.get("cached_tokens") or 0),
            finish_reason=choice.get("finish_reason") or "stop",
            latency_s=latency_s,
            replica=data.get("replica"),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BackendError(f"malformed completions response: {str(data)[:300]}") from exc
