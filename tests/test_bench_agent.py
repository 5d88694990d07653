"""`jobs.bench.agent`'s rounds: the warm-up first, then the modes in both orders, each round's episodes by mode."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from jobs.agent.chat_loop import ChatEpisode, LoopSettings
from jobs.bench import agent


def test_rounds_warm_the_engine_then_play_the_modes_in_alternating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    played: list[tuple[str, int]] = []
    resets: list[int] = []

    def episode(client: Any, model: str, dataset: str, steps: list[Any], mode: str, *rest: Any) -> ChatEpisode:
        played.append((mode, len(steps)))
        return ChatEpisode(mode, [], float(len(played)))

    monkeypatch.setattr(agent, "run_episode", episode)
    steps = list(range(24))
    args = SimpleNamespace(rounds=3, dataset="locomo")
    rounds = agent.play(None, lambda: resets.append(1), steps, ["a", "b"], LoopSettings(4096, 2560), 6, [], args)
    assert played == [("blocking_parallel", agent.WARM_TURNS), ("a", 24), ("b", 24), ("b", 24), ("a", 24),
                      ("a", 24), ("b", 24)]  # fmt: skip
    assert len(resets) == 6  # each mode's episode on emptied caches (the warm-up needs none)
    assert [[e.mode for e in r] for r in rounds] == [["a", "b"]] * 3  # each round's episodes in the modes' order
    assert [e.e2e_s for e in rounds[1]] == [5.0, 4.0]  # round 2 played b first


def test_the_record_keeps_each_modes_window_of_recent_turns_as_the_service_resolves_its_entry() -> None:
    modes = ["none", "blocking_parallel", "background_parallel", "rolling_parallel"]
    windows = agent.kept_windows(LoopSettings(4096, 2560), modes, 6)
    # A spliced background result must fit under background_threshold; rolling's compaction at τ is blocking's.
    assert windows == {"blocking_parallel": 1024, "background_parallel": 640, "rolling_parallel": 1024}
