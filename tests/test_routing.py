"""The placement policy (pure): routing keys, replica order, the cost model's decisions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from serving.routing import (
    CostModel,
    PlacementInput,
    PromptShape,
    RouteKey,
    common_prefix,
    contiguous_slots,
    history_key,
    new_prefill_tokens,
    order_replicas,
    place,
)

HISTORY = tuple(range(1000, 5000))  # a 4000-token "rendered history"


def chained(ends: list[int], tail: int = 40) -> tuple[PromptShape, ...]:
    """prefix_exact prompts: history[0:end] + a tail of its own."""
    return tuple(PromptShape((*HISTORY[:end], *range(-tail * (k + 1), -tail * k)), end) for k, end in enumerate(ends))


def independent(ends: list[int], tail: int = 40) -> tuple[PromptShape, ...]:
    starts = [0, *ends[:-1]]
    return tuple(
        PromptShape(HISTORY[s:e] + tuple(range(-tail * (k + 1), -tail * k)), e if s == 0 else 0)
        for k, (s, e) in enumerate(zip(starts, ends, strict=True))
    )


def inputs(prompts: tuple[PromptShape, ...], **kw: object) -> PlacementInput:
    base: dict[str, object] = {
        "prompts": prompts, "session": "s1", "has_session": True, "assumed_cached_tokens": 4000,
        "replicas": 2, "max_tokens": 32, "block_size": 128,
    }  # fmt: skip
    return PlacementInput(**(base | kw))  # type: ignore[arg-type]


def test_route_key_round_trips_and_leaves_plain_sessions_alone() -> None:
    key = RouteKey("agent:42|x", 3, ("r1", "r2"))
    assert RouteKey.decode(key.encode()) == key
    assert RouteKey.decode(RouteKey(None, 1).encode()) == RouteKey(None, 1)
    assert RouteKey.decode("agent-42") is None and RouteKey.decode(None) is None and RouteKey.decode("") is None
    assert RouteKey.decode("pc1:x::s") is None  # malformed: treated as a plain session id
    assert key.avoiding("r3").avoid == ("r1", "r2", "r3") and key.avoiding("r1") == key


def test_replica_order_rotates_to_the_slot_and_drops_failed_replicas() -> None:
    walk = ["a", "b", "c"]
    assert order_replicas(walk, RouteKey("s", 0)) == ["a", "b", "c"]
    assert order_replicas(walk, RouteKey("s", 4)) == ["b", "c", "a"]
    assert order_replicas(walk, RouteKey("s", 0, ("a",))) == ["b", "c"]
    assert order_replicas(walk, RouteKey("s", 1, ("a", "b", "c"))) == ["b", "c", "a"]  # all failed: offer all again
    assert order_replicas([], RouteKey("s")) == []


def test_contiguous_ranges_put_the_last_range_on_home() -> None:
    assert contiguous_slots(8, 2) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert contiguous_slots(5, 2) == [1, 1, 1, 0, 0]
    assert contiguous_slots(7, 3) == [2, 2, 2, 1, 1, 0, 0]
    assert contiguous_slots(3, 8) == [2, 1, 0]
    assert contiguous_slots(4, 1) == [0, 0, 0, 0]


@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=60), st.integers(0, 60))
def test_common_prefix_matches_a_plain_scan(a: list[int], b: list[int], known: int) -> None:
    expect = 0
    while expect < min(len(a), len(b)) and a[expect] == b[expect]:
        expect += 1
    assert common_prefix(tuple(a), tuple(b), min(known, expect)) == expect


def test_new_prefill_counts_whole_blocks_of_the_shared_chain() -> None:
    prompts = chained([1024, 2048, 3072, 4000])
    cold = new_prefill_tokens(prompts, cached=0, block_size=128)
    # prompt k reuses prompt k-1's history part (whole blocks); the tails are always computed
    assert cold == 4000 + 4 * 40
    warm = new_prefill_tokens(prompts, cached=4000, block_size=128)
    assert warm == 4 * 40 + (4000 % 128)  # only the tails and the partial last block
    assert new_prefill_tokens(independent([1024, 2048, 3072, 4000]), 0, 128) == 4000 + 4 * 40


def test_prefill_dominated_compaction_is_pinned_to_the_session() -> None:
    placement = place(inputs(chained([1024, 2048, 3072, 4000])), "auto", CostModel())
    assert placement.kind == "pinned" and placement.slots == [0, 0, 0, 0]
    assert placement.reason.startswith("prefill dominates")
    assert placement.estimates["spread"].new_prefill_tokens > placement.estimates["pinned"].new_prefill_tokens
    assert [RouteKey.decode(k) for k in placement.routes()] == [RouteKey("s1", 0)] * 4


def test_decode_dominated_compaction_is_spread_in_contiguous_ranges() -> None:
    cost = CostModel(prefill_tokens_per_s=20_000, decode_step_s=0.02, batch_growth=0.5)
    placement = place(inputs(independent([1024, 2048, 3072, 4000]), max_tokens=512), "auto", cost)
    assert placement.kind == "spread" and placement.slots == [1, 1, 0, 0]
    assert placement.reason.startswith("decode dominates")
    assert placement.estimates["spread"].seconds < placement.estimates["pinned"].seconds


def test_a_cold_history_without_session_assumes_nothing_cached() -> None:
    placement = place(inputs(chained([1024, 2048]), has_session=False, session="history-x"), "auto", CostModel())
    assert placement.assumed_cached_tokens == 0
    assert placement.estimates["pinned"].new_prefill_tokens == 2048 + 80


def test_requested_modes_override_the_model() -> None:
    prompts = chained([1024, 2048, 3072, 4000])
    assert place(inputs(prompts), "spread", CostModel()).slots == [1, 1, 0, 0]
    assert place(inputs(prompts, max_tokens=4096), "pinned", CostModel(batch_growth=5)).kind == "pinned"
    robin = place(inputs(prompts), "round_robin", CostModel())
    assert robin.kind == "round_robin" and all(RouteKey.decode(k) == RouteKey(None) for k in robin.routes())


def test_one_replica_or_one_chunk_is_always_pinned() -> None:
    assert place(inputs(chained([1024, 2048]), replicas=1), "spread", CostModel()).reason.startswith("one replica")
    assert place(inputs(chained([4000])), "auto", CostModel()).reason.startswith("one chunk")


def test_history_key_depends_on_the_history_start_only() -> None:
    assert history_key(HISTORY, 16) == history_key((*HISTORY[:40], 1, 2, 3), 16)
    assert history_key(HISTORY, 16) != history_key((7, *HISTORY), 16)
