"""Where a CPU model replica computes: its own cores on its host, chosen from its rank on the node.

vLLM-CPU binds an engine's compute threads by `VLLM_CPU_OMP_THREADS_BIND`, read when the engine
spawns its worker. Its default, `auto`, picks the cores per NUMA node and not per engine, so every
engine on a host computes on the same cores (on a 2-core host: core 0 for all, core 1 reserved for
the schedulers). `cores` gives each replica `cpu_threads` cores of its own, by its local rank on
the node (Ray Serve numbers the replicas of a deployment on each node 0, 1, ...); `nobind` leaves
the threads to the OS; `auto` is vLLM's choice.

`PlacedLLMServer` is ray.serve.llm's `LLMServer` with that variable set before the engine starts
(given to `build_llm_deployment(..., deployment_cls=PlacedLLMServer)`), and without Ray's usage telemetry.
Both it and the GPU models' server are `CompactionLLMServer`: the coordinators' chunk prompts come and go as
plain dicts, so a coordinator imports neither vLLM nor ray.serve.llm.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from ray import serve
from ray.serve.llm import LLMServer

from serving.models import CpuBinding as Binding

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
logger = logging.getLogger("ray.serve")


def replica_cores(local_rank: int, threads: int, host: Sequence[int]) -> list[int]:
    """The cores of replica `local_rank`: consecutive runs of `threads` host cores, wrapping around
    when more replicas share the host than it has runs (they then share cores)."""
    cores = sorted(host)
    if threads >= len(cores):
        return cores
    start = (local_rank % (len(cores) // threads)) * threads
    return cores[start : start + threads]


def core_list(cores: Sequence[int]) -> str:
    """vLLM's notation of a core list: "0", "0-1", "0,2"."""
    if list(cores) == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


def bind_value(binding: Binding, local_rank: int, threads: int | None, sharing: int, host: Sequence[int]) -> str:
    """The `VLLM_CPU_OMP_THREADS_BIND` value of a replica; `threads` None: the host's cores over the `sharing`
    replicas that may run on it."""
    if binding != "cores":
        return binding
    each = threads or max(1, len(host) // max(1, min(sharing, len(host))))
    return core_list(replica_cores(local_rank, each, host))


class CompactionLLMServer(LLMServer):
    """ray.serve.llm's model server, plus `completions` with the request and its answer as plain dicts."""

    async def completions_from_dict(
        self, body: dict[str, Any], raw_request_info: Any = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        from ray.serve.llm.openai_api_models import CompletionRequest

        async for item in await self.completions(CompletionRequest(**body), raw_request_info):
            if isinstance(item, list):  # a stream's batch of lines: no caller asks for a stream
                raise TypeError("completions_from_dict answers whole completions only (stream: false)")
            yield item.model_dump(mode="json")  # the completion, or vLLM's error


class PlacedLLMServer(CompactionLLMServer):
    """ray.serve.llm's model server, its engine bound to this replica's cores before it starts."""

    async def __init__(  # type: ignore[misc]
        self,
        llm_config: Any,
        *,
        cpu_binding: Binding = "auto",
        cpu_threads: int | None = None,
        per_host: int = 1,
        **kwargs: Any,
    ) -> None:
        local_rank = int(getattr(serve.get_replica_context().rank, "local_rank", 0) or 0)
        host = sorted(os.sched_getaffinity(0))
        os.environ[BIND_ENV] = bind_value(cpu_binding, local_rank, cpu_threads, per_host, host)
        logger.info("replica %d of this host computes on %s=%s", local_rank, BIND_ENV, os.environ[BIND_ENV])
        await super().__init__(llm_config, **kwargs)

    async def _start_engine(self) -> None:
        """The engine, without ray.serve.llm's usage-telemetry actor: a detached actor, created on the first
        replica's start, that imports vLLM once more (on the CPU machines about 20 s of CPU and 850 MB held for
        the cluster's life) only to record tags for Ray's usage statistics."""
        if self.engine is None:
            raise ValueError("Engine is not set")
        await self.engine.start()
