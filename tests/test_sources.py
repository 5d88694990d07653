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


def test_the_templates_tool_markup_is_no_source(tokenizer: HFChatTokenizer) -> None:
    """A chunk end inside a message with tool calls or inside a tool result: its source is that message's text as
    the segments read it, never the chat template's `<tool_call>` or `<tool_response>` around it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "run_command", "arguments": '{"command": "ls"}'}}
    listing = "\n".join(f"src/pkg/module_{i}.py {i * 37} bytes" for i in range(60))
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the package, then tell me its biggest module."},
        {"role": "assistant", "content": "Listing it. " + "I read the sizes first. " * 12, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": listing},
        {"role": "assistant", "content": "The biggest is src/pkg/module_59.py."},
    ]
    history = render_history(parse_messages(messages), tokenizer)
    assert "<tool_response>" in tokenizer.decode(history.token_ids)  # the template marks them up
    chunks = partition(history.message_starts[1], len(history.token_ids), 40, 16)
    shared = ChunkSources(history, tokenizer, [c.end for c in chunks])
    everything = Source(*(s.text for s in segments(history, tokenizer, 0, len(history.token_ids))))
    words = set(everything.text.split()) | {"tool_call", "tool_response"}
    for chunk in chunks:
        before = Source(*(s.text for s in segments(history, tokenizer, 0, chunk.end)))
        one_pass = shared.source(chunk.end)
        assert all(one_pass.contains(word) == before.contains(word) for word in words), chunk
        assert not one_pass.contains("tool_call") and not one_pass.contains("tool_response")
