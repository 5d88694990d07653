"""What background compaction costs an agent's turns on one engine, per scheduling rule.

    python -m jobs.bench.yielding [--rules fcfs,priority,yield,yield-256] [--turns 6] [--json PATH]
    python -m jobs.bench.yielding --speed auto,nobind,0-1,0-1/active [--dtype bfloat16] [--busy 2]

Per rule, one in-process vLLM-CPU engine (the CPU default model) and two phases on the same prefix
cache state: an agent's turns alone (its ~2.5k-token history cached, each turn a new observation
and a 24-token answer, `--gap` seconds of tool time between turns), then the same turns while a
cold background compaction (another session's 4k-token history, parallel, 512-token chunks) runs at
background priority. Printed per rule: turn latency p50/p95 alone and beside the compaction, their
ratio, and how long the compaction took. Rules:

    fcfs        vLLM's default scheduling; every request equal
    priority    vLLM's priority policy, background prompts at priority 1
    yield       serving.scheduler.YieldingScheduler: background neither prefills nor is admitted
                beside an agent request (compaction.pacing)
    yield-N     the same, steps led by background work capped at N tokens
    yield-N-solo  the same, and background requests do not even decode beside the agent's

`--speed` measures instead one bare engine per `VLLM_CPU_OMP_THREADS_BIND` value (auto, nobind, or a core
list such as 0-1), each optionally with OpenMP's wait policy (`0-1/active`; by default the CPU engines' own,
serving.cpu.CPU_ENGINE_ENV): a cold prefill of 3,072 tokens, then 32 decode steps of one sequence and of eight.
`--busy N` runs N processes that only spin beside each engine (a host whose cores other work shares).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from compaction.backend import GenerationRequest
from compaction.compactor import Compactor
from compaction.history import parse_messages, template_view
from compaction.pacing import AGENT, BACKGROUND, YieldRule
from compaction.tokenizer import HFChatTokenizer
from jobs.bench.common import sayer, table
from jobs.data.conversations import LOCOMO_PATH, locomo_messages, truncate_history

say = sayer("bench-yield")


def engine_kwargs(rule: str) -> dict[str, Any]:
    """vLLM engine arguments of a rule name (see the module docstring)."""
    if rule in ("fcfs", "priority"):
        return {"scheduling_policy": rule, "scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"}
    parts = rule.split("-")
    if parts[0] != "yield" or len(parts) > 3 or (len(parts) == 3 and parts[2] != "solo"):
        raise ValueError(f"unknown rule {rule!r}: fcfs, priority, yield, yield-N or yield-N-solo")
    step = int(parts[1]) if len(parts) > 1 and parts[1] != "0" else None
    yielding = YieldRule(background_step_tokens=step, decode_beside=len(parts) < 3)
    return {
        "scheduling_policy": "priority",
        "scheduler_cls": "serving.scheduler.YieldingScheduler",
        "additional_config": yielding.config(),
    }


def prompt_ids(tokenizer: HFChatTokenizer, messages: list[dict[str, Any]]) -> tuple[int, ...]:
    views = [template_view(m) for m in parse_messages(messages)]
    return tuple(tokenizer.encode(tokenizer.render(views, add_generation_prompt=True)))


async def turn(backend: Any, prompt: tuple[int, ...], tag: str) -> float:
    began = time.perf_counter()
    request = GenerationRequest(prompt, max_tokens=24, min_tokens=24, request_id=tag, priority=AGENT)
    await backend.generate(request)
    return time.perf_counter() - began


async def agent_turns(backend: Any, prompts: list[tuple[int, ...]], gap_s: float, until: asyncio.Task | None) -> list:
    """The agent's turns, `gap_s` apart; with `until`, only those that start before it is done."""
    latencies = []
    for i, prompt in enumerate(prompts):
        if until is not None and until.done():
            break
        latencies.append(await turn(backend, prompt, f"turn-{i}"))
        await asyncio.sleep(gap_s)
    return latencies


class AtPriority:
    """Sends every request of a compaction at one priority."""

    def __init__(self, inner: Any, priority: int) -> None:
        self.inner, self.priority = inner, priority

    async def generate(self, request: GenerationRequest) -> Any:
        from dataclasses import replace

        return await self.inner.generate(replace(request, priority=self.priority))


async def measure(backend: Any, tokenizer: HFChatTokenizer, args: argparse.Namespace) -> dict[str, Any]:
    conversations = [locomo_messages(s) for s in json.loads(Path(args.data).read_text())[:2]]
    agent = truncate_history(conversations[0], tokenizer, args.history_tokens)
    rest = conversations[0][len(agent) :]
    prompts = [
        prompt_ids(tokenizer, [*agent, {"role": "user", "content": "\n".join(m["content"] for m in rest[k : k + 6])}])
        for k in range(0, 6 * args.turns, 6)
    ]
    other = truncate_history(conversations[1], tokenizer, args.background_tokens)
    compactor = Compactor(tokenizer, AtPriority(backend, BACKGROUND), context_window=8192, block_size=128)
    options = {"chunk_tokens": 512, "max_chunk_summary_tokens": 32, "fixed_output_tokens": True, "reuse_chunks": False}

    async def warm() -> None:
        await backend.reset_prefix_cache()
        await turn(backend, prompt_ids(tokenizer, agent), "warm")

    await warm()
    alone = await agent_turns(backend, prompts, args.gap, None)
    await warm()
    began = time.perf_counter()
    background = asyncio.create_task(compactor.compact(other, options))
    await asyncio.sleep(args.delay)
    beside = await agent_turns(backend, prompts, args.gap, background)
    result = await background
    compaction_s = time.perf_counter() - began
    return {
        "turns_alone": len(alone),
        "alone_p50_s": round(statistics.median(alone), 3),
        "alone_p95_s": round(max(alone), 3),
        "turns_beside": len(beside),
        "beside_p50_s": round(statistics.median(beside), 3) if beside else None,
        "beside_p95_s": round(max(beside), 3) if beside else None,
        "p95_ratio": round(max(beside) / max(alone), 2) if beside else None,
        "compaction_s": round(compaction_s, 2),
        "compaction_prefill": result.stats.computed_prefill_tokens,
    }


async def engine_speed(backend: Any) -> dict[str, Any]:
    """Cold prefill rate and decode step times of one engine (prompts of random ids: nothing cached)."""
    rng = random.Random(0)
    ids = tuple(rng.randrange(1000, 40000) for _ in range(3072))
    began = time.perf_counter()
    await backend.generate(GenerationRequest(ids, max_tokens=1, request_id="prefill"))
    prefill = time.perf_counter() - began
    began = time.perf_counter()
    await backend.generate(GenerationRequest(ids, max_tokens=33, min_tokens=33, request_id="one"))
    one = (time.perf_counter() - began) / 32
    began = time.perf_counter()
    batch = [GenerationRequest((*ids, k), max_tokens=33, min_tokens=33, request_id=f"eight-{k}") for k in range(8)]
    await asyncio.gather(*(backend.generate(r) for r in batch))
    eight = (time.perf_counter() - began) / 32
    return {
        "prefill_tok_s": round(3072 / prefill, 1),
        "decode_1_ms": round(1000 * one, 1),
        "decode_8_ms": round(1000 * eight, 1),
    }


def run_speed(args: argparse.Namespace) -> int:
    import os
    import subprocess

    from serving.backends import VLLMBackend
    from serving.cpu import CPU_ENGINE_ENV
    from serving.local import hush
    from serving.weights import fetch

    hush()
    model = fetch()
    rows = []
    for spec in args.speed.split(","):
        bind, _, wait = spec.partition("/")
        wait = wait or CPU_ENGINE_ENV["OMP_WAIT_POLICY"]
        say(f"binding {bind}, OpenMP waits {wait}, {args.busy} busy beside: starting an engine ({args.dtype})")
        os.environ |= {"VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_WAIT_POLICY": wait}  # the engine's processes inherit
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            backend = VLLMBackend.start(model, max_model_len=8192, dtype=args.dtype)
            try:
                speed = asyncio.run(engine_speed(backend))
            finally:
                backend.shutdown()
        finally:
            for process in busy:
                process.kill()
        rows.append({"binding": bind, "omp_wait": wait.lower(), "busy": args.busy, "dtype": args.dtype, **speed})
        say(" ".join(f"{k}={v}" for k, v in rows[-1].items()))
    print(table(rows, list(rows[0])))
    return 0


def run(args: argparse.Namespace) -> int:
    from serving.backends import VLLMBackend
    from serving.local import hush
    from serving.weights import fetch

    hush()
    model = fetch()
    tokenizer = HFChatTokenizer.from_path(model)
    rows = []
    for rule in args.rules.split(","):
        say(f"rule {rule}: starting an engine")
        backend = VLLMBackend.start(model, max_model_len=8192, **engine_kwargs(rule))
        try:
            row = {"rule": rule, **asyncio.run(measure(backend, tokenizer, args))}
        finally:
            backend.shutdown()
        say(" ".join(f"{k}={v}" for k, v in row.items()))
        rows.append(row)
    print(table(rows, list(rows[0])))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="fcfs,priority,yield,yield-256")
    parser.add_argument("--turns", type=int, default=6, help="agent turns per phase")
    parser.add_argument("--gap", type=float, default=0.5, help="tool time between the agent's turns (s)")
    parser.add_argument("--delay", type=float, default=0.3, help="first turn this long after the compaction starts")
    parser.add_argument("--history-tokens", type=int, default=2500)
    parser.add_argument("--background-tokens", type=int, default=4096)
    parser.add_argument("--data", default=str(LOCOMO_PATH))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--speed", help="bare engine speed per VLLM_CPU_OMP_THREADS_BIND value instead (e.g. auto,0-1)")
    parser.add_argument("--dtype", default=None, help="--speed: the engines' dtype (default: serving.cpu.cpu_dtype)")
    parser.add_argument("--busy", type=int, default=0, help="--speed: processes that only spin beside each engine")
    args = parser.parse_args(argv)
    if args.busy and not args.speed:
        parser.error("--busy applies to --speed only")
    if args.speed:
        from serving.cpu import cpu_dtype

        args.dtype = args.dtype or cpu_dtype()
        return run_speed(args)
    for rule in args.rules.split(","):
        try:
            engine_kwargs(rule)
        except ValueError as exc:
            parser.error(str(exc))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
