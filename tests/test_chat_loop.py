"""The chat agent loop of the benchmark (pure): it continues from the compaction exactly as the protocol says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from jobs.agent.chat_loop import LoopSettings, run_episode
from jobs.data.episodes import Document, Question


class FakeChat:
    """Answers every call; compacts the third one (head = system + summary, replaces through the last message)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **request: Any) -> Any:
        messages = list(request["messages"])  # the client goes on appending to its own list
        self.requests.append({**request, "messages": messages})
        compaction: dict[str, Any] = {"status": "none", "prompt_tokens": 10 * len(messages), "stall_s": 0.0}
        if len(self.requests) == 3:
            head = [messages[0], {"role": "user", "content": "Summary of the earlier conversation (compacted):\nS"}]
            stats = {"computed_prefill_tokens": 5, "cached_prompt_tokens": 7, "reused_chunks": 1}
            compaction |= {"status": "applied", "messages": head, "replaces_through": len(messages) - 1}
            compaction |= {"stall_s": 1.5, "source": "blocking", "stats": stats}
        usage = SimpleNamespace(
            prompt_tokens=9, completion_tokens=2, prompt_tokens_details=SimpleNamespace(cached_tokens=4)
        )
        message = SimpleNamespace(content="Paris")
        return SimpleNamespace(
            choices=[SimpleNamespace(message=message)], usage=usage, model_extra={"compaction": compaction}
        )


def test_the_loop_continues_from_the_compacted_history() -> None:
    steps = [
        Document("d0", ({"role": "user", "content": "Alice moved to Paris."},)),
        Document("d1", ({"role": "user", "content": "Bob stayed in Oslo."},)),
        Question("q0", "Where did Alice move?", "Paris", "1"),
        Document("d2", ({"role": "user", "content": "Carol went to Rome."},)),
    ]
    fake = FakeChat()
    settings = LoopSettings(compact_threshold=1000, background_threshold=600)
    episode = run_episode(fake, "m", "locomo", steps, "blocking_parallel", settings, chunks_hint=2)
    last = fake.requests[-1]["messages"]
    assert [m["content"] for m in last] == [
        last[0]["content"],
        "Summary of the earlier conversation (compacted):\nS",
        "Question: Where did Alice move?\nAnswer in a few words, using what you have read above.",
        "Paris",
        "Carol went to Rome.",
    ]
    entry = fake.requests[0]["extra_body"]["context_management"][0]
    assert (
        entry["compact_threshold"] == 1000 and entry["strategy"] == "parallel" and "background_threshold" not in entry
    )
    assert all(
        r["extra_headers"]["x-session-id"] == fake.requests[0]["extra_headers"]["x-session-id"] for r in fake.requests
    )
    totals = episode.totals()
    assert totals["compactions"] == 1 and totals["stall_s"] == 1.5 and totals["reused_chunks"] == 1
    assert totals["compaction_prefill"] == 5 and totals["turn_cached"] == 16 and totals["f1"] == 1.0


def test_modes_differ_only_in_their_entry() -> None:
    settings = LoopSettings(compact_threshold=4096, background_threshold=2560, summary_tokens=32)
    assert settings.entry("none", 6) is None
    sequential = settings.entry("blocking_sequential", 6)
    assert sequential is not None and sequential["max_chunk_summary_tokens"] == 192  # matched decode volume
    background = settings.entry("background_parallel", 6)
    assert background is not None and background["background_threshold"] == 2560
    assert settings.entry("blocking_parallel", 6) == {
        k: v for k, v in background.items() if k not in ("background_threshold", "apply_background")
    }
    assert settings.entry("rolling_parallel", 6) == {**background, "apply_background": "rolling"}
