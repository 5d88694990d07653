"""The simulator's parts with real objects and tiny configs: shapes against the real layouts, the cache, the engine's
arithmetic, placement through serving.routing, compaction modes and admission, grids and profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import simpy

from compaction.compactor import Compactor
from compaction.history import parse_messages
from compaction.layouts import SEGMENT, TARGET
from compaction.options import LAYOUTS, CompactionOptions
from compaction.pacing import BACKGROUND
from compaction.tokenizer import ChatTokenizer
from jobs.data.conversations import locomo_messages, truncate_history
from jobs.sim.cache import PrefixCache
from jobs.sim.cluster import Cluster, CompactionJob
from jobs.sim.config import SimConfig
from jobs.sim.grid import SimGrid, load_grid, run_grid
from jobs.sim.profiles import DecodePoint, EngineProfile, PrefillPoint, Source, load_profile, profile_names
from jobs.sim.runner import simulate
from jobs.sim.shapes import ChunkTokens, SegmentIds, prompt_lengths
from serving.models import load_catalogue
from serving.routing import PromptShape, common_prefix, new_prefill_tokens
from serving.sizing import gpu_fit
from tests.fakes import ChatMLTokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def toy_profile(**fields: Any) -> EngineProfile:
    """1,000 prompt tokens/s with no attention term; decode 10 ms + 1 ms per sequence; block 4; 10k tokens of KV."""
    base: dict[str, Any] = {
        "name": "toy", "model": "toy", "hardware": "toy", "block_size": 4, "kv_tokens": 10_000, "max_num_seqs": 64,
        "max_batched_tokens": 64, "active_params_b": 1.0, "attention_layers": 0, "attention_width": 1,
        "kv_bytes_per_token": 1.0, "memory_bytes_per_s": 1e30,
        "prefill": PrefillPoint(tokens=1000, seconds=1.0),
        "decode": [DecodePoint(batch=1, context=0, seconds=0.011), DecodePoint(batch=11, context=0, seconds=0.021)],
        "sources": [Source(figure="made up for tests", url="tests/test_sim.py")],
    }  # fmt: skip
    return EngineProfile.model_validate(base | fields)


@pytest.fixture(scope="module")
def history(tokenizer: ChatTokenizer, locomo: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return truncate_history(locomo_messages(locomo[0]), tokenizer, 2500)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strategy", ["parallel", "sequential"])
def test_prompt_lengths_match_the_real_layouts(
    tokenizer: ChatTokenizer, history: list[dict[str, Any]], layout: str, strategy: str
) -> None:
    options = CompactionOptions(strategy=strategy, layout=layout, chunk_tokens=512)  # type: ignore[arg-type]
    plan = Compactor(tokenizer, object(), context_window=8192, block_size=128).plan(  # type: ignore[arg-type]
        parse_messages(history), options
    )
    extra = ChunkTokens(
        tail=0,
        target_tags=sum(len(tokenizer.encode(t)) for t in TARGET),
        segment_tags=sum(len(tokenizer.encode(t)) for t in SEGMENT),
    )
    shapes = prompt_lengths("h", plan.span, options, 128, extra)
    assert [s.tokens for s in shapes] == [len(p.body) for p in plan.prompts]
    assert [s.history_prefix for s in shapes] == [p.raw_prefix for p in plan.prompts]


def test_segment_ids_compare_like_the_token_tuples_they_stand_for() -> None:
    history = tuple(range(1000))
    real = [history[:end] + (5000 + k,) * 7 for k, end in enumerate((256, 512, 700))]
    fake = [SegmentIds([("h", 0, end), (("tail", k), 0, 7)]) for k, end in enumerate((256, 512, 700))]
    for a, b, x, y in zip(real, real[1:], fake, fake[1:], strict=False):
        assert common_prefix(a, b) == common_prefix(x, y) == len(a) - 7
    assert fake[0][3:10] == SegmentIds([("h", 3, 10)]) and len(fake[2]) == 707
    cached = 300
    shapes_real = [PromptShape(p, len(p) - 7) for p in real]
    shapes_fake = [PromptShape(p, len(p) - 7) for p in fake]
    assert new_prefill_tokens(shapes_real, cached, 16) == new_prefill_tokens(shapes_fake, cached, 16)


def test_cache_reads_whole_blocks_and_evicts_the_least_recently_used_unpinned_chain() -> None:
    cache = PrefixCache(capacity=64, block=4)
    reserved = cache.reserve("a", 10)
    assert reserved == 12
    cache.extend("a", 10, reserved)  # 8 tokens in whole blocks become the chain
    assert cache.lookup("a", 100, 101) == 8 and cache.lookup("a", 7, 8) == 4 and cache.lookup("b", 50, 51) == 0
    cache.release("a", reserved - 8)
    assert (cache.cached, cache.allocated) == (8, 0)
    b = cache.reserve("b", 40)
    cache.extend("b", 40, b)
    cache.release("b", 0)
    pinned = cache.reserve("b", 0)  # b is read by a running request
    assert cache.reserve(None, 20) == 20  # needs 20 of 16 free: a's tail block goes (LRU, unpinned), never b
    assert cache.chains == {"a": 4, "b": 40} and cache.evicted == 4
    assert cache.reserve(None, 4) == 4  # and then the rest of a
    assert "a" not in cache.chains and cache.evicted == 8
    assert cache.reserve(None, 64) == 0  # b is pinned: no room
    cache.release("b", pinned)


def test_one_request_takes_its_prefill_plus_its_decode_steps() -> None:
    env = simpy.Environment()
    cluster = Cluster(env, toy_profile(), 1, "pinned")
    first = cluster.turn("s", "h", 500, 10)
    env.run()
    # 0.5 s of prefill, then 10 steps of 11 ms
    assert first.finished == pytest.approx(0.5 + 10 * 0.011)
    second = cluster.turn("s", "h", 600, 10)
    env.run()
    assert second.cached_tokens == 508  # the turn's prompt and answer, in whole blocks
    assert second.finished - second.submitted == pytest.approx(0.092 + 10 * 0.011)


def test_a_batch_decodes_together_and_a_waiting_prefill_slows_each_step() -> None:
    env = simpy.Environment()
    cluster = Cluster(env, toy_profile(), 1, "pinned")
    a, b = cluster.turn("a", "a", 8, 100), cluster.turn("b", "b", 8, 100)
    env.run()
    # a prefills (8 ms) and decodes; b's prefill (8 ms of work) then shares steps with a's decode: each step is
    # 11 ms of decode + a 63-token chunk (63 ms), so b's prefill spans 0.127 steps (9.4 ms); then 12 ms steps for both.
    assert b.started == pytest.approx(0.008)
    shared = 0.008 / 0.063 * (0.011 + 0.063)
    assert a.finished == pytest.approx(0.008 + shared + (100 - 0.008 / 0.063) * 0.012)
    assert b.finished == pytest.approx(a.finished + (0.008 / 0.063) * 0.011)  # alone again for its last 0.127


@pytest.mark.parametrize("yielding", [True, False])
def test_a_background_prefill_yields_to_an_agent_turn_and_resumes(yielding: bool) -> None:
    env = simpy.Environment()
    cluster = Cluster(env, toy_profile(), 1, "pinned", yielding=yielding)
    background = cluster.submit(0, 2000, 1, "other", 0, kind="chunk", priority=BACKGROUND)
    env.run(until=0.5)  # a quarter of its 2 s prefill done
    turn = cluster.turn("s", "h", 100, 1)
    env.run()
    if yielding:  # the turn takes over the prefill at once; the background one resumes with what it had done
        assert turn.finished == pytest.approx(0.5 + 0.1 + 0.011)
        assert background.finished == pytest.approx(turn.finished + 1.5 + 0.011, abs=0.02)
    else:  # FCFS: the turn waits for the whole background prefill
        assert turn.finished > 2.0 and background.finished < turn.finished
    assert background.cached_tokens == 0 and background.computed_tokens == 2000


def test_background_prefill_beside_agent_decode_takes_at_most_its_allowance_a_step() -> None:
    """An agent decodes 400 tokens; a 100-token background prompt arrives. Held (the CPU rule), it waits for the
    agent's last token. With 16 tokens a step beside the agent, it is done within the agent's turn, which pays
    the prefill's 0.1 s of work, 16 tokens' worth a step."""
    finished = {}
    for beside in (0, 16):
        env = simpy.Environment()
        cluster = Cluster(env, toy_profile(), 1, "pinned", beside_tokens=beside)
        turn = cluster.turn("s", "h", 8, 400)
        env.run(until=0.05)
        background = cluster.submit(0, 100, 1, "other", 0, kind="chunk", priority=BACKGROUND)
        env.run()
        finished[beside] = (turn.finished, background.finished)
    (alone, after), (slowed, during) = finished[0], finished[16]
    assert after > alone and during < slowed  # held until the agent's turn ends / done within it
    assert during == pytest.approx(0.05 + 100 / 16 * (0.011 + 0.016), abs=0.02)
    assert slowed - alone == pytest.approx(0.1, abs=0.02)


def test_a_waiting_turn_raises_a_background_compaction_to_the_agents_priority() -> None:
    env = simpy.Environment()
    cluster = Cluster(env, toy_profile(), 1, "pinned", homes={"s": 0})
    prompts = prompt_lengths("h", (0, 2000), CompactionOptions(chunk_tokens=500), 4, ChunkTokens(tail=20))
    job = CompactionJob("s", "h", prompts, [8] * len(prompts), 0, 2000, priority=BACKGROUND)
    compaction = env.process(cluster.compact(job))
    env.run(until=0.1)
    busy = [cluster.turn("a", "a", 50, 400)]  # another session decodes: background prefill is held meanwhile
    env.run(until=1.0)
    assert not compaction.triggered
    cluster.escalate(job)
    env.run(until=compaction)
    assert busy[0].finished != busy[0].finished  # done while the other turn still decodes (finished is NaN)


def test_pinned_compaction_reads_the_agents_cache_and_round_robin_recomputes() -> None:
    computed = {}
    for policy in ("pinned", "round_robin", "spread"):
        env = simpy.Environment()
        cluster = Cluster(env, toy_profile(), 2, policy, homes={"s": 0})  # type: ignore[arg-type]
        cluster.turn("s", "h", 2000, 4)
        env.run()
        prompts = prompt_lengths("h", (0, 2000), CompactionOptions(chunk_tokens=500), 4, ChunkTokens(tail=20))
        job = CompactionJob("s", "h", prompts, [8] * len(prompts), 2000, 2000)
        env.process(cluster.compact(job))
        env.run()
        outcome = cluster.outcomes[-1]
        computed[policy] = outcome.computed_tokens
        if policy == "spread":
            assert outcome.replicas == [1, 1, 0, 0]  # contiguous ranges, the last on home (serving.routing)
    assert computed["pinned"] == 4 * 20  # chunk borders on whole blocks, the history cached: only the 4 tails
    assert computed["pinned"] < computed["spread"] < computed["round_robin"]


def test_background_compaction_hides_the_stall_and_admission_refuses_beyond_the_queue() -> None:
    """10 agents on 2 H100s leave the fleet room (about three quarters busy). 20 saturate it once the summaries of
    earlier compactions are carried at the head, as the service carries them: background runs then wait at tau as
    long as blocking ones."""
    base = SimConfig(
        profile="h100-llama-3.1-8b", replicas=2, sessions=10, duration_s=900, tau=16384, dataset="synthetic",
        summary_tokens=1024, chunk_tokens=2048, think_s=2.0,
    )  # fmt: skip
    blocking = simulate(base)
    background = simulate(base.model_copy(update={"mode": "background"}))
    assert blocking["compactions"] > 10 and background["background_used"] > 0
    assert background["stall_total_s"] < 0.5 * blocking["stall_total_s"]
    tight = simulate(base.model_copy(update={"max_running_compactions": 1, "max_queued_compactions": 0}))
    assert tight["refused"] > 0 and tight["queue_wait_mean_s"] == 0.0


def test_grids_expand_run_and_skip_finished_cells(tmp_path: Path) -> None:
    grid = SimGrid(
        name="t",
        base={"sessions": 3, "duration_s": 120, "dataset": "synthetic", "tau": 8192, "summary_tokens": 512},
        axes={"replicas": [1, 2], "policy": ["pinned", "round_robin"]},
    )
    assert len(grid.cells()) == 4
    store = run_grid(grid, tmp_path, quiet=True)
    rows = store.read().to_pylist()
    assert len(rows) == 4 and {r["policy"] for r in rows} == {"pinned", "round_robin"}
    assert run_grid(grid, tmp_path, run=lambda c: pytest.fail("finished cells must be skipped"), quiet=True)
    with pytest.raises(ValueError, match="not SimConfig fields"):
        SimGrid(name="t", axes={"replica": [1]})
    for config in ("sim-h100-fleet.yaml", "sim-h100-tau.yaml"):
        assert load_grid(ROOT / "jobs" / "configs" / config).cells()


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_loads_cites_its_figures_and_sizes_kv_like_the_catalogue(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name and profile.sources and all(s.url for s in profile.sources)
    spec = load_catalogue().get(profile.model)
    assert profile.block_size == spec.block_size
    if spec.device == "gpu":
        assert profile.kv_tokens == gpu_fit(spec).kv_tokens
    assert profile.prefill_seconds(0, profile.prefill.tokens) == pytest.approx(profile.prefill.seconds)


@pytest.mark.parametrize(("parallelism", "slowdown"), [(None, 1.0), (2, 1.0), (1, 2.0)])
def test_replicas_sharing_a_host_slow_each_other_down(parallelism: int | None, slowdown: float) -> None:
    from jobs.sim.engine import Replica, Request

    env = simpy.Environment()
    profile = toy_profile(host_parallelism=parallelism)
    replicas = [Replica(env, i, profile) for i in range(2)]
    for replica in replicas:
        replica.peers = replicas if parallelism is not None else []
    requests = [Request(1000, 0, None, 0, False, "chunk", env.event()) for _ in replicas]
    for replica, request in zip(replicas, requests, strict=True):
        replica.submit(request)
    env.run()
    # 1,000 tokens at 1,000 tokens/s alone: 1 s; two replicas on one core's worth of host: 2 s each.
    assert [r.finished for r in requests] == pytest.approx([slowdown, slowdown], rel=0.02)
    late = Request(1000, 0, None, 0, False, "chunk", env.event())
    replicas[0].submit(late)  # alone on the host now: full speed
    env.run()
    assert late.finished - late.submitted == pytest.approx(1.0, rel=0.02)
