"""Prefill and latency of every (strategy, layout) pair on the real CPU engine.

    python -m jobs.bench.compaction --history-tokens 4096 --chunk-tokens 512 \
        --json results/bench.json [--matched-decode]

Loads the CPU default model once, builds a history of about `--history-tokens` tokens from a
LoCoMo conversation, and compacts it with every pair, each on a fresh prefix cache ("cold"),
then again with the agent's own history already cached ("warm": the history was just sent as
the agent's next-turn prompt, as /v1/chat/completions would). Every figure is the engine's own
count. `--matched-decode` adds parallel vs sequential at the same total output-token budget,
every summary forced to exactly its budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from compaction.backend import GenerationRequest
from compaction.compactor import Compactor
from compaction.history import parse_messages, template_view
from compaction.options import LAYOUTS
from compaction.result import CompactionStats
from compaction.tokenizer import HFChatTokenizer
from jobs.bench.common import sayer, table
from jobs.data.conversations import LOCOMO_PATH, load_conversation, truncate_history

say = sayer("bench")


COLUMNS = [
    "strategy", "layout", "cache", "input_tokens", "chunks", "prompt_tokens", "cached_prompt_tokens",
    "computed_prefill_tokens", "prefill_floor_tokens", "prefill_ratio", "output_tokens", "latency_s",
]  # fmt: skip


def bench_row(stats: CompactionStats, cache: str) -> dict[str, Any]:
    row = {c: getattr(stats, c) for c in COLUMNS if hasattr(stats, c)}
    row["cache"] = cache
    row["prefill_ratio"] = round(stats.computed_prefill_tokens / stats.prefill_floor_tokens, 3)
    row["latency_s"] = round(stats.latency_s, 2)
    return {c: row[c] for c in COLUMNS}


async def prime_agent_cache(compactor: Compactor, messages: list[dict[str, Any]]) -> None:
    """Send the history as the agent's next-turn prompt, so the engine caches it as an agent would have."""
    views = [template_view(m) for m in parse_messages(messages)]
    prompt = compactor.tokenizer.encode(compactor.tokenizer.render(views, add_generation_prompt=True))
    await compactor.backend.generate(GenerationRequest(tuple(prompt), max_tokens=1, request_id="agent-turn"))


async def layouts_runs(compactor: Compactor, backend: Any, messages: list, args: argparse.Namespace) -> list[dict]:
    rows = []
    chunks = len(compactor.plan(messages, {"chunk_tokens": args.chunk_tokens}).prompts)
    pairs = [("sequential", None)] + [("parallel", layout) for layout in LAYOUTS]
    for cache in ("cold", "warm"):
        for strategy, layout in pairs:
            options: dict[str, Any] = {"strategy": strategy, "chunk_tokens": args.chunk_tokens, "clearing": "off"}
            options["max_chunk_summary_tokens"] = args.chunk_summary_tokens * (chunks if layout is None else 1)
            if layout:
                options["layout"] = layout
            await backend.reset_prefix_cache()
            if cache == "warm":
                await prime_agent_cache(compactor, messages)
            result = await compactor.compact(messages, options)
            rows.append(bench_row(result.stats, cache))
            say(f"{cache} {strategy} {layout or ''}: ratio {rows[-1]['prefill_ratio']}, {rows[-1]['latency_s']} s")
    return rows


async def matched_decode(compactor: Compactor, backend: Any, messages: list, args: argparse.Namespace) -> list[dict]:
    """Parallel vs sequential with the same total output budget, each summary forced to its budget."""
    chunks = len(compactor.plan(messages, {"chunk_tokens": args.chunk_tokens}).prompts)
    rows = []
    budgets = (("sequential", args.chunk_summary_tokens * chunks), ("parallel", args.chunk_summary_tokens))
    for strategy, budget in budgets:
        await backend.reset_prefix_cache()
        options = {
            "strategy": strategy, "chunk_tokens": args.chunk_tokens,
            "max_chunk_summary_tokens": budget, "fixed_output_tokens": True, "clearing": "off",
        }  # fmt: skip
        result = await compactor.compact(messages, options)
        rows.append(bench_row(result.stats, "cold/matched"))
        say(f"matched decode {strategy}: {result.stats.output_tokens} output tokens, {rows[-1]['latency_s']} s")
    return rows


async def run(args: argparse.Namespace) -> int:
    from serving.backends import VLLMBackend
    from serving.local import hush, verbose_requested
    from serving.weights import fetch

    if not verbose_requested(args.verbose):
        hush()

    model = fetch()
    tokenizer = HFChatTokenizer.from_path(model)
    messages = truncate_history(load_conversation(args.conversation), tokenizer, args.history_tokens)
    say(f"history: {len(messages)} messages (<= {args.history_tokens} tokens); starting vLLM-CPU")
    backend = VLLMBackend.start(
        model, max_model_len=8192, kv_cache_gib=4
    )  # shared_full: 8 prompts of up to 4.6k tokens, float32 KV
    try:
        compactor = Compactor(tokenizer, backend, context_window=backend.max_model_len, block_size=backend.block_size)
        say(f"engine cache block: {backend.block_size} tokens")
        rows = await layouts_runs(compactor, backend, messages, args)
        if args.matched_decode:
            rows += await matched_decode(compactor, backend, messages, args)
    finally:
        backend.shutdown()
    print(table(rows, COLUMNS))
    matched = [r for r in rows if r["cache"] == "cold/matched"]
    if matched:
        seq, par = matched
        print(f"\nmatched decode: parallel/sequential latency = {par['latency_s'] / seq['latency_s']:.3f} "
              f"({par['output_tokens']} vs {seq['output_tokens']} output tokens)")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
        say(f"rows written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversation", type=Path, default=LOCOMO_PATH)
    parser.add_argument("--history-tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--chunk-summary-tokens", type=int, default=32, help="Budget per chunk summary")
    parser.add_argument("--matched-decode", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="Write the rows here")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's logs too (or VERBOSE=1)")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
