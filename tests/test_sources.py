"""The sources of every chunk, built in one pass, read as the per-chunk segments of the history do."""

from __future__ import annotations

from compaction.checks.grounding import Source
from compaction.checks.sources import ChunkSources
from compaction.extractive import segments
from compaction.history import parse_messages
from compaction.partition import partition
from compaction.render import render_history
from compaction.tokenizer import HFChatTokenizer


def test_one_pass_sources_find_what_per_chunk_sources_find(tokenizer: HFChatTokenizer) -> None:
    long_tool = " ".join(f"retry_out_{i} read src/mod{i}.py took {i}ms" for i in range(120))
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the flaky test in tests/test_io.py; never touch CI config."},
        {"role": "assistant", "content": "Reading the file. The root cause is the 30 s timeout."},
        {"role": "user", "content": long_tool},
        {"role": "assistant", "content": "Switched to poll_interval=0.5 in Runner.wait. Done!"},
    ]
    history = render_history(parse_messages(messages), tokenizer)
    chunks = partition(history.message_starts[1], len(history.token_ids), 48, 16)
    shared = ChunkSources(history, tokenizer, [c.end for c in chunks])
    everything = Source(*(s.text for s in segments(history, tokenizer, 0, len(history.token_ids))))
    words = set(everything.text.split())  # what lies before a chunk's end and what lies after it
    assert len(chunks) > 30
    for chunk in chunks:
        before = Source(*(s.text for s in segments(history, tokenizer, 0, chunk.end)))
        one_pass = shared.source(chunk.end, "Keep the file names.")
        assert all(one_pass.contains(word) == before.contains(word) for word in words), chunk
        assert one_pass.contains("file names") and not before.contains("file names")
