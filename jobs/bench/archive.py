"""The archive, measured: bytes kept per archived token, recall and search latency, and one tenant's handles never
found by another.

    python -m jobs.bench.archive [--traces 8] [--tokens 20000] [--out results/archive.json]

Plans compactions of generated coding-agent traces (`jobs.data.traces`, 512-token chunks, the real SmolLM2
tokenizer), archives every chunk in a local folder (`serving.archive`, as the coordinators do with
`archive: true`), then recalls every handle, searches each trace's planted facts by their words, and asks for each
handle as another tenant. No engine, no service: the store alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from compaction.archive import archived_chunks
from compaction.compactor import Compactor
from compaction.tokenizer import HFChatTokenizer
from jobs.bench.common import sayer
from jobs.data.traces import coding_trace
from serving.archive import Archive, ArchiveConfig

say = sayer("archive")


def quantiles(seconds: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(seconds, n=20)
    return {"p50_ms": round(1000 * statistics.median(seconds), 3), "p95_ms": round(1000 * cuts[18], 3)}


def main(argv: list[str] | None = None) -> int:
    from serving.weights import fetch

    parser = argparse.ArgumentParser(prog="python -m jobs.bench.archive", description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=8, help="coding traces archived (default 8)")
    parser.add_argument("--tokens", type=int, default=20_000, help="tokens per trace (default 20,000)")
    parser.add_argument("--out", type=Path, default=Path("results/archive.json"))
    args = parser.parse_args(argv)
    tokenizer = HFChatTokenizer.from_path(fetch())
    compactor = Compactor(tokenizer, None, context_window=1 << 20, block_size=16)  # type: ignore[arg-type]
    folder = Path(tempfile.mkdtemp(prefix="archive"))
    archive = Archive(ArchiveConfig(uri=str(folder)))
    handles: list[str] = []
    queries: list[tuple[str, str]] = []  # (words, the session they were planted in)
    tokens = 0
    put_s = 0.0
    for seed in range(args.traces):
        trace = coding_trace(seed, args.tokens, tokenizer)
        plan = compactor.plan(trace.messages, {"chunk_tokens": 512, "keep_recent_tokens": 0})
        chunks = archived_chunks(plan.history.token_ids, [(c.start, c.end) for c in plan.chunks], tokenizer)
        began = time.perf_counter()
        archive.put("bench", f"trace-{seed}", chunks)
        put_s += time.perf_counter() - began
        handles += [c.handle for c in chunks]
        tokens += sum(c.tokens for c in chunks)
        queries += [(fact.text, f"trace-{seed}") for fact in trace.facts]
    stored = sum(f.stat().st_size for f in folder.rglob("*.json"))
    recall = []
    for handle in handles:
        began = time.perf_counter()
        assert archive.recall("bench", handle) is not None
        recall.append(time.perf_counter() - began)
    search, found = [], 0
    for words, session in queries:
        began = time.perf_counter()
        hits = archive.search("bench", words, session=session)
        search.append(time.perf_counter() - began)
        texts = [kept.text.lower() for h in hits if (kept := archive.recall("bench", h.handle)) is not None]
        found += any(words.lower() in text for text in texts)
    leaked = sum(archive.recall("other", handle) is not None for handle in handles)
    figures = {
        "chunks": len(handles),
        "tokens": tokens,
        "bytes": stored,
        "bytes_per_token": round(stored / tokens, 2),
        "put_ms_per_chunk": round(1000 * put_s / len(handles), 3),
        "recall": quantiles(recall),
        "search": {**quantiles(search), "chunks_scanned": len(handles)},
        "planted_facts_found_by_search": f"{found}/{len(queries)}",
        "handles_found_by_another_tenant": leaked,
    }
    for key, value in figures.items():
        say(f"{key}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    return 0 if leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
