"""What planning one compaction costs, in time and peak memory, as the history grows.

    python -m jobs.bench.planning [--tokens 25000,50000,100000,200000] [--baseline /path/to/other/checkout]
                                  [--baseline-max-tokens 50000] [--chunk-tokens N]

Plans a parallel compaction of a LoCoMo history (conversations repeated to the size) with the real
SmolLM2 tokenizer, for a model the size of the GPU catalogue's (131,072-token window, 16-token cache
blocks, 1,024 sequences per engine), the way the coordinator does before admission: `Compactor.plan`
(render once, partition, lay out every prompt and its retry) and `Compactor.reusable` (the chunk-cache
lookups), first with an empty chunk cache, then again with every chunk of the first plan cached (the
next compaction of a grown session); `reused s` is that whole compaction, planned, run and merged, every
chunk taken from the cache (no prompt is sent; the median of five): what a rolling session's threshold waits
for at the least.
Rows:

- `smallest`: at the smallest chunk this code allows (the caps: `max_chunks`, `max_history_tokens`);
- `16`: at 16-token chunks (one cache block), the caps lifted: the planning algorithm alone;
- with `--chunk-tokens N`, at N-token chunks only (e.g. 512 and `--tokens 4000`: the agent benchmark's).

Each measurement runs in a fresh process (time without tracemalloc; peak from a second, traced run).
`--baseline` runs the 16-token rows with another checkout's code (e.g. the main branch) in the same
run, up to `--baseline-max-tokens` (its planning grows with the square of the history).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

WINDOW, BLOCK, SEQUENCES = 131_072, 16, 1024
REPEATS = 5  # reused compactions timed per row (the median)
ROOT = Path(__file__).resolve().parents[1]
# What each cached chunk holds as its summary (the merge reads it like a model's).
SUMMARY = "Caroline told Melanie about the LGBTQ support group she went to on 7 May 2023."


def history(tokens: int, tokenizer: Any) -> list[dict[str, Any]]:
    """A system prompt, then LoCoMo conversations repeated until the history holds `tokens` tokens."""
    from jobs.data.conversations import LOCOMO_PATH, load_conversation, truncate_history

    turns = load_conversation(LOCOMO_PATH)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    while len(messages) * 60 < tokens * 1.2:  # a LoCoMo turn renders to about 60 tokens
        messages += turns
    return truncate_history(messages, tokenizer, tokens)


def measure(tokens: int, chunk: str, traced: bool) -> dict[str, Any]:
    """One row, in this process: plan cold, cache every chunk, plan again (warm), then compact with every chunk
    cached (reused)."""
    import asyncio
    import statistics

    from compaction.checks.grounding import salient_tokens
    from compaction.chunk_cache import ChunkCache
    from compaction.compactor import Compactor
    from compaction.result import ChunkStats
    from compaction.tokenizer import HFChatTokenizer
    from serving.weights import model_dir

    tokenizer = HFChatTokenizer.from_path(model_dir())
    messages = history(tokens, tokenizer)
    cache = ChunkCache(1_000_000)
    kwargs: dict[str, Any] = {"context_window": WINDOW, "block_size": BLOCK, "cache": cache}
    limits = _limits(chunk)
    if limits is not None:
        kwargs["limits"] = limits
    compactor = Compactor(tokenizer, None, **kwargs)  # type: ignore[arg-type]  # planning sends nothing
    size = int(chunk) if chunk.isdigit() else _smallest(compactor, tokens)
    options = {"chunk_tokens": size, "max_chunk_summary_tokens": 64}
    row: dict[str, Any] = {"tokens": tokens, "chunk_tokens": size}
    for phase in ("cold", "warm"):
        if traced:
            tracemalloc.start()
        began = time.perf_counter()
        plan = compactor.plan(messages, options)
        compactor.reusable(plan)
        row[f"{phase}_s"] = round(time.perf_counter() - began, 3)
        if traced:
            row[f"{phase}_peak_mib"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
            tracemalloc.stop()
        row["chunks"], row["layout"] = len(plan.chunks), plan.options.layout
        for prompt in plan.prompts:  # what a finished run leaves in the cache
            c = prompt.chunk
            stats = ChunkStats(
                index=c.index, start=c.start, end=c.end, prompt_tokens=0, cached_prompt_tokens=0,
                computed_prefill_tokens=0, output_tokens=0, summary_tokens=0, latency_s=0.0, retries=0, failovers=0,
                status="ok",
            )  # fmt: skip
            cache.put(plan.scope, plan.history.token_ids, c, prompt.token_ids, SUMMARY, stats)
        del plan
    if traced:
        return row  # times come from the untraced run
    asyncio.run(compactor.run(compactor.plan(messages, options)))  # once first, as a long-lived coordinator has
    forget = getattr(salient_tokens, "cache_clear", lambda: None)
    times = []
    for _ in range(REPEATS):
        forget()  # ... but not with these lines: they are new to it
        began = time.perf_counter()
        reused = asyncio.run(compactor.run(compactor.plan(messages, options)))
        times.append(time.perf_counter() - began)
        assert reused.stats.reused_chunks == row["chunks"], "every chunk should have come from the cache"
    row["reused_s"] = round(statistics.median(times), 3)
    return row


def _limits(chunk: str) -> Any:
    """This code's caps for the GPU-sized model (None on code without caps); lifted for the 16-token rows."""
    try:
        from compaction.partition import PlanLimits
    except ImportError:
        return None
    if chunk == "16":
        return PlanLimits(max_chunks=10**9, max_history_tokens=10**9)
    return PlanLimits.for_window(WINDOW, SEQUENCES)


def _smallest(compactor: Any, tokens: int) -> int:
    limits = getattr(compactor, "limits", None)
    if limits is None:
        return BLOCK
    return max(BLOCK, -(-tokens // limits.max_chunks))


def run_one(code: Path, tokens: int, chunk: str) -> dict[str, Any]:
    """A row measured in fresh processes with `code` first on the path: timed once, traced once."""
    row: dict[str, Any] = {}
    for traced in (False, True):
        # -P: this file's folder stays off the path (its compaction.py would shadow the package)
        cmd = [sys.executable, "-P", __file__, "--one", f"{tokens}:{chunk}:{int(traced)}"]
        env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1"}
        out = subprocess.run(cmd, env=env, cwd=code, check=True, capture_output=True, text=True).stdout
        row |= {k: v for k, v in json.loads(out.strip().splitlines()[-1]).items() if not (traced and k.endswith("_s"))}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="25000,50000,100000,200000")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to measure beside this one")
    parser.add_argument("--baseline-max-tokens", type=int, default=50_000)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="measure at this chunk size instead")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        tokens, chunk, traced = args.one.split(":")
        print(json.dumps(measure(int(tokens), chunk, traced == "1")))
        return
    sizes = [int(t) for t in args.tokens.split(",")]
    chunk = str(args.chunk_tokens or BLOCK)
    runs = [] if args.chunk_tokens else [("this", ROOT, "smallest")]
    if args.baseline is not None:
        runs.append(("baseline", args.baseline.resolve(), chunk))
    runs.append(("this", ROOT, chunk))
    head = f"{'code':<9} {'chunk':>8} {'tokens':>7} {'chunks':>6} {'layout':<12} {'cold s':>7} {'peak MiB':>9}"
    print(f"{head} {'warm s':>7} {'peak MiB':>9} {'reused s':>8}", flush=True)
    for name, code, chunk in runs:
        for tokens in sizes:
            if name == "baseline" and tokens > args.baseline_max_tokens:
                print(f"{name:<9} {chunk:>8} {tokens:>7} not run (over --baseline-max-tokens)", flush=True)
                continue
            r = run_one(code, tokens, chunk)
            print(
                f"{name:<9} {r['chunk_tokens']:>8} {tokens:>7} {r['chunks']:>6} {r['layout']:<12} {r['cold_s']:>7}"
                f" {r['cold_peak_mib']:>9} {r['warm_s']:>7} {r['warm_peak_mib']:>9} {r.get('reused_s', '-'):>8}",
                flush=True,
            )


if __name__ == "__main__":
    main()
