"""The grounding check on the real engine: SmolLM2-135M summaries of a coding trace."""

from __future__ import annotations

from typing import Any

import pytest

from compaction.checks.grounding import Source
from compaction.checks.quality import repeated_sentences
from compaction.compactor import Compactor
from compaction.history import parse_messages, template_view
from compaction.tokenizer import HFChatTokenizer
from jobs.data.facts import coding_history

pytestmark = pytest.mark.engine


async def test_a_real_compaction_invents_nothing_and_keeps_what_the_agent_needs(
    engine: Any, tokenizer: HFChatTokenizer
) -> None:
    """Defaults on SmolLM2: no invented salient token reaches the summary (by the grounding check and its retry,
    and independently of the stats); the user's constraint verbatim, pinned lines, content-chosen tails, no loop."""
    known = coding_history(1, 2048, tokenizer)
    compactor = Compactor(tokenizer, engine, context_window=engine.max_model_len, block_size=engine.block_size)
    plan = compactor.plan(known.messages, {"chunk_tokens": 512, "max_chunk_summary_tokens": 48})
    result = await compactor.run(plan)
    stats = result.stats
    chunks = stats.per_chunk
    assert len(chunks) >= 3 and all(c.first_grounding is not None and c.first_verdict for c in chunks)
    assert stats.ungrounded_chunks == [c.index for c in chunks if (c.first_grounding or 0) < 0.7]
    assert all(c.retries == 1 for c in chunks if c.index in stats.ungrounded_chunks)
    assert all(c.ungrounded == [] and c.grounding == 1.0 for c in chunks)
    # independently of the stats: the summary states nothing absent from the history and the instructions
    tails = [tokenizer.decode(p.tail) for p in plan.prompts]
    source = Source(*(template_view(m)["content"] for m in parse_messages(known.messages)), *tails)
    assert source.check(result.summary).ungrounded == ()
    constraint = next(f for f in known.facts if f.kind == "constraint")
    assert constraint.text in result.messages[1].text() and stats.user_words_kept >= 1
    assert sum(c.pinned_lines for c in chunks) > 0
    assert {c.content for c in chunks} <= {"tool_output", "code", "requests", "dialogue"}
    assert repeated_sentences(result.summary) == 0
