"""The coordinator's backend: chunk prompts to a ray.serve.llm deployment, placed by routing key.

`ReplicaBackend.generate` sends a token-id `/v1/completions` request through a Serve handle, as a plain
dict that the model server builds into vLLM's request (`serving.placement.CompactionLLMServer`): the
coordinator imports neither vLLM nor ray.serve.llm.
The routing key travels as the request's session id; `SessionRouter` picks the replica, and
`DeploymentHandle.choose_replica` tells us which one it picked before the request is dispatched,
so every Generation names its replica. A replica that fails (actor died, engine error) is
added to the key's avoid list and the prompt is sent again, up to `max_failovers` times.

Cancellation: when the compaction is cancelled (deadline, client gone), the call is cancelled on
the replica explicitly (`DeploymentResponseGenerator.cancel()`): Ray Serve 2.60 does not do it
for a streaming call whose consumer is cancelled, and the replica's cancellation is what makes
ray.serve.llm's vLLM engine abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from compaction.backend import Generation, GenerationRequest
from compaction.errors import BackendError, InvalidInput, Overloaded
from compaction.pacing import engine_args
from serving.routing import RouteKey

RETRY_AFTER_S = 5.0
COMPLETIONS = "completions_from_dict"  # serving.placement.CompactionLLMServer
logger = logging.getLogger(__name__)


class ReplicaFailed(Exception):
    """One replica could not answer one prompt; another replica may."""

    def __init__(self, replica: str | None, cause: str) -> None:
        super().__init__(f"{replica}: {cause}")
        self.replica = replica


class ReplicaBackend:
    """`compaction.backend.Backend` over the replicas of one model deployment."""

    def __init__(self, handle: DeploymentHandle, model_id: str, *, max_failovers: int = 2) -> None:
        self.model_id = model_id
        self.max_failovers = max_failovers
        self._handle = handle.options(method_name=COMPLETIONS, stream=True)

    async def generate(self, request: GenerationRequest) -> Generation:
        key = RouteKey.decode(request.routing_key) or RouteKey(request.routing_key)
        failures: list[str] = []
        for attempt in range(self.max_failovers + 1):
            try:
                return replace(await self._once(request, key), failovers=attempt)
            except ReplicaFailed as failed:
                failures.append(str(failed))
                key = key.avoiding(failed.replica)
        logger.warning("no replica of %s could serve a prompt: %s", self.model_id, "; ".join(failures))
        raise BackendError(f"no replica of {self.model_id} could serve the prompt; retry shortly")

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "min_tokens": request.min_tokens,
            "temperature": request.temperature,
            "repetition_penalty": request.repetition_penalty,
            "priority": request.priority,
            "cache_salt": request.cache_salt,
            "vllm_xargs": engine_args(request) or None,
        }

    async def _once(self, request: GenerationRequest, key: RouteKey) -> Generation:
        body = self._body(request)
        handle = self._handle.options(session_id=key.encode())
        began = time.perf_counter()
        replica: str | None = None
        final: Any = None
        stream: DeploymentResponse[Any] | DeploymentResponseGenerator[Any] | None = None
        try:
            async with handle.choose_replica(body, None) as selection:
                replica = selection.replica_id
                stream = handle.dispatch(selection, body, None)
                assert isinstance(stream, DeploymentResponseGenerator)
                async for item in stream:
                    final = item
        except (asyncio.CancelledError, RequestCancelledError):
            if stream is not None:
                stream.cancel()  # abort the prompt on the engine
            raise
        except BackPressureError as exc:
            raise Overloaded(f"{self.model_id} replicas are saturated; retry shortly", RETRY_AFTER_S) from exc
        except RayError as exc:
            raise ReplicaFailed(replica, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
        return self._generation(final, replica, len(request.prompt_token_ids), time.perf_counter() - began)

    def _generation(self, final: Any, replica: str | None, prompt_len: int, latency: float) -> Generation:
        """The server's answer, a plain dict: vLLM's completion or its error (`CompactionLLMServer`)."""
        error = final.get("error") if isinstance(final, dict) else None
        if error:
            if 400 <= int(error["code"]) < 500:
                raise InvalidInput("messages", f"the model rejected a chunk prompt: {error['message']}")
            raise ReplicaFailed(replica, f"engine error {error['code']}: {error['message']}")
        if not isinstance(final, dict) or not final.get("choices"):
            raise ReplicaFailed(replica, "the replica returned no completion")
        choice, usage = final["choices"][0], final["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return Generation(
            text=choice.get("text") or "",
            output_tokens=int(usage.get("completion_tokens") or 0),
            prompt_tokens=int(usage.get("prompt_tokens") or prompt_len),
            cached_prompt_tokens=int(details.get("cached_tokens") or 0),
            finish_reason=choice.get("finish_reason") or "stop",
            latency_s=latency,
            replica=replica,
        )

    async def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache (benchmarks and demos start cold)."""
        await self._handle.options(stream=False).broadcast("reset_prefix_cache").results_async()
