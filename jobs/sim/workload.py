"""Agent sessions: what each turn adds to the history, when compaction runs, and the run's configuration.

A session loops: wait `think_s` (tools, the user), append the next observation of its stream (a LoCoMo session or a
HotpotQA paragraph per turn, as `jobs.data.episodes` builds them, counted in tokens), then send one turn (prompt =
the history, `answer_tokens` out) to its home replica. What each turn does about compaction is the service's own
rule (`compaction.turn_policy.decide`, over the entry `SimConfig.entry` builds, with the session's recent growth
and idle time as the service measures them):
  - blocking: the turn whose prompt passes `tau` waits for the whole compaction of the history;
  - background: a turn past `background_share x tau` (or one turn's growth short of `tau`), of an agent that leaves
    the engine idle, starts compacting that snapshot at background priority (`yielding`: its prompts prefill only
    while the replica runs no agent request) and goes on at once; when it is done, its compacted prompt is
    prefilled on the home replica at background priority too (`warm`), and the session's next turn continues from
    the summary plus everything after the snapshot (`apply_background` "ready"; "threshold": only the turn passing
    `tau`). The turn passing `tau` while it still runs raises it to the agent's priority and waits only for the
    rest. A refused background run leaves the turn past `tau` to compact blocking.
A refused blocking compaction (429) is retried after `retry_after_s`; the wait counts as stall.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Hashable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, cast

import simpy
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compaction.options import CompactionOptions, Layout, Strategy
from compaction.pacing import AGENT, BACKGROUND
from compaction.turn_policy import Background, ContextManagement, decide, wants_background
from jobs.agent.tools import ToolTime
from jobs.sim.cluster import Cluster, CompactionJob, CompactionOutcome
from jobs.sim.shapes import ChunkTokens, prompt_lengths
from serving.routing import PlacementMode

Mode = Literal["blocking", "background"]
CODEX = ToolTime()  # the Codex fit of jobs.agent.tools
Dataset = Literal["locomo", "hotpotqa", "synthetic"]
GENERATION_PROMPT_TOKENS = 3  # "<|im_start|>assistant\n": opens the answer, stays in the history
END_OF_TURN_TOKENS = 2  # "<|im_end|>\n" after the answer
SUMMARY_HEADER_TOKENS = 16  # the user turn that carries the merged summary
RECENT_TURNS = 4  # the turns whose growth and idle time the service weighs (serving.turns.RECENT_TURNS)


class SimConfig(BaseModel):
    """One simulated run: a deployment, a fleet of agents, a compaction policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    profile: str = Field("h100-llama-3.1-8b", min_length=1, description="Engine profile (jobs/sim/profiles/NAME.yaml).")
    replicas: int = Field(8, ge=1, le=4096, description="Replicas of the model.")
    sessions: int = Field(100, ge=1, le=200_000, description="Concurrent agent sessions.")
    duration_s: float = Field(3600.0, gt=0, le=7 * 86_400, description="Simulated time.")
    policy: PlacementMode = Field("auto", description="Compaction placement (serving.routing).")
    mode: Mode = Field("blocking", description="blocking: the crossing turn waits; background: soft threshold first.")
    tau: int = Field(32_768, ge=1024, le=1_048_576, description="compact_threshold: compact before a prompt this long.")
    background_share: float = Field(
        0.75, gt=0.05, lt=1.0, description="background mode: soft threshold as a share of tau."
    )
    yielding: bool = Field(
        True, description="Engines run the yield rule and background compactions go at background priority."
    )
    background_beside_tokens: int | None = Field(
        None,
        ge=0,
        le=1_048_576,
        description="Yielding: tokens of an agent-led step background prefill may take (None: the catalogue's).",
    )
    apply_background: Literal["ready", "threshold"] = Field(
        "ready", description="background mode: a finished run is applied at the next turn, or only at tau."
    )
    warm: bool = Field(True, description="background mode: a finished run's compacted prompt is prefilled on home.")
    strategy: Strategy = Field("parallel", description="parallel (chunked) or sequential compaction.")
    chunk_tokens: int = Field(4096, ge=16, le=1_048_576, description="B, the chunk size (parallel).")
    layout: Layout = Field("prefix_exact", description="Chunk prompt layout.")
    summary_tokens: int = Field(
        2048, ge=16, le=65_536, description="Decode volume of one compaction, split evenly over its chunks."
    )
    keep_recent_tokens: int = Field(0, ge=0, le=1_048_576, description="Newest tokens kept verbatim.")
    answer_tokens: int = Field(128, ge=1, le=32_768, description="Tokens an agent turn decodes.")
    think_s: float = Field(5.0, ge=0, le=3600, description="Mean time between an answer and the next turn (tools).")
    tool_model: Literal["exponential", "codex"] = Field(
        "exponential",
        description="Time between turns: exponential with mean think_s, or the fit to real Codex tool calls "
        "(jobs.agent.tools: median 0.63 s, mean 4.0 s capped at 60 s; think_s unused).",
    )
    system_tokens: int = Field(64, ge=0, le=65_536, description="The system prompt, kept through compactions.")
    dataset: Dataset = Field("locomo", description="What each turn appends: LoCoMo sessions, HotpotQA paragraphs.")
    warm_start: bool = Field(True, description="Sessions start at a random history length below tau (steady state).")
    ramp_s: float = Field(60.0, ge=0, le=86_400, description="Sessions start uniformly over this many seconds.")
    max_running_compactions: int | None = Field(None, ge=1, le=1_000_000, description="Coordinator slots per model.")
    max_queued_compactions: int | None = Field(None, ge=0, le=1_000_000, description="Queue beyond them; then 429.")
    retry_after_s: float = Field(5.0, ge=0, le=3600, description="A refused blocking compaction retries after this.")
    tail_tokens: int = Field(90, ge=0, le=4096, description="Tokens of a chunk prompt's instruction tail.")
    seed: int = Field(0, ge=0, description="Random seed of arrivals, think times and stream offsets.")

    @model_validator(mode="after")
    def _compaction_shrinks(self) -> SimConfig:
        if self.system_tokens + self.summary_tokens + self.keep_recent_tokens + SUMMARY_HEADER_TOKENS >= self.tau // 2:
            raise ValueError(
                f"summary_tokens + keep_recent_tokens + system_tokens must stay under tau/2 ({self.tau // 2}); "
                "otherwise compactions would follow each other; lower them or raise tau"
            )
        return self

    def options(self) -> CompactionOptions:
        return CompactionOptions(strategy=self.strategy, chunk_tokens=self.chunk_tokens, layout=self.layout)

    def entry(self) -> ContextManagement:
        """The context_management entry the service would be sent for this run's compaction policy."""
        background = int(self.background_share * self.tau) if self.mode == "background" else None
        return ContextManagement(
            type="compaction", compact_threshold=self.tau, background_threshold=background,
            keep_recent_tokens=self.keep_recent_tokens, apply_background=self.apply_background,
        )  # fmt: skip


@dataclass
class _Background:
    """A session's background compaction: the run, then (with `warm`) its compacted prompt prefilled."""

    job: CompactionJob
    snapshot: int  # history tokens when it started
    compaction: simpy.Process
    ready: simpy.Process  # done when the result may be applied without waiting


@dataclass
class Recorder:
    """Per-run tallies the sessions write."""

    stalls: list[float] = field(default_factory=list)  # agent-visible wait per compaction
    session_s: float = 0.0  # summed time sessions were active
    refused: int = 0  # compactions refused at admission
    background_used: int = 0  # tau crossings served (partly) by a background compaction


def synthetic_stream(rng: random.Random, count: int = 512) -> list[int]:
    """Observation sizes of a tool-using agent: log-normal around 700 tokens."""
    return [max(16, int(rng.lognormvariate(6.3, 0.8))) for _ in range(count)]


@lru_cache(maxsize=4)
def dataset_stream(dataset: Dataset) -> tuple[int, ...]:
    """Tokens each step of the dataset's agent stream adds (SmolLM2's tokenizer as the common yardstick)."""
    from compaction.history import parse_messages, template_view
    from compaction.tokenizer import HFChatTokenizer
    from jobs.agent.pipeline import question_prompt
    from jobs.data.conversations import SHARED_DATA
    from jobs.data.datasets import load_hotpotqa, load_locomo
    from jobs.data.episodes import Document, hotpotqa_steps, locomo_steps
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    if dataset == "locomo":
        steps = locomo_steps(load_locomo(SHARED_DATA / "locomo10.json"))
    else:
        steps = hotpotqa_steps(load_hotpotqa(SHARED_DATA / "hotpotqa_dev_distractor_sample100.json"))
    sizes = []
    for step in steps:
        raw = step.messages if isinstance(step, Document) else ({"role": "user", "content": question_prompt(step)},)
        views = [template_view(m) for m in parse_messages(list(raw))]
        sizes.append(len(tokenizer.encode(tokenizer.render(views))))
    return tuple(sizes)


class Session:
    """One agent: its history length, its chain in the cache, its background compaction."""

    def __init__(self, index: int, config: SimConfig, cluster: Cluster, stream: tuple[int, ...], rng: random.Random):
        self.id = f"session-{index}"
        self.config, self.cluster, self.stream, self.rng = config, cluster, stream, rng
        self.epoch = 0
        self.position = rng.randrange(len(stream))
        start = rng.uniform(0, config.tau * 0.95) if config.warm_start else 0.0
        self.tokens = config.system_tokens + int(start)
        self.background: _Background | None = None
        self.growths: tuple[int, ...] = ()  # how much each of its last turns grew the prompt (as the ingress counts)
        self.gaps: tuple[float, ...] = ()  # its last idle times between a reply and the next turn

    @property
    def namespace(self) -> Hashable:
        return (self.id, self.epoch)

    def job(self, snapshot: int, last_turn: int, priority: int = AGENT) -> CompactionJob:
        c = self.config
        span = (c.system_tokens, snapshot - c.keep_recent_tokens)
        block = self.cluster.profile.block_size
        prompts = prompt_lengths(self.namespace, span, c.options(), block, ChunkTokens(tail=c.tail_tokens))
        per_chunk = max(16, c.summary_tokens // len(prompts))
        return CompactionJob(
            self.id,
            self.namespace,
            prompts,
            [per_chunk] * len(prompts),
            snapshot - last_turn,
            span[1] - span[0],
            priority=priority,
        )

    def compacted_tokens(self, outcome: CompactionOutcome) -> int:
        c = self.config
        return c.system_tokens + SUMMARY_HEADER_TOKENS + outcome.output_tokens + c.keep_recent_tokens

    def run(self, recorder: Recorder) -> Generator[simpy.Event, Any, None]:
        env, c = self.cluster.env, self.config
        entry = c.entry()
        yield env.timeout(self.rng.uniform(0, c.ramp_s))
        recorder.session_s += max(0.0, c.duration_s - env.now)
        while env.now < c.duration_s:
            think = self._think()
            yield env.timeout(think)
            self.gaps = (*self.gaps, think)[-RECENT_TURNS:]
            observation = self.stream[self.position % len(self.stream)]
            self.position += 1
            self.tokens += observation
            growth, idle = max(self.growths, default=0), sum(self.gaps) / len(self.gaps)
            action = decide(self.tokens, entry, self._state(), True, growth, idle)
            if action == "start_background":
                self._start_background(observation)
            elif action in ("apply", "wait", "compact"):
                yield from self._compact(observation, recorder)
                if wants_background(self.tokens, growth, entry, idle):  # the compacted prompt is the next snapshot
                    self._start_background(observation)
            turn = self.cluster.turn(self.id, self.namespace, self.tokens + GENERATION_PROMPT_TOKENS, c.answer_tokens)
            yield turn.done
            grown = observation + GENERATION_PROMPT_TOKENS + c.answer_tokens + END_OF_TURN_TOKENS
            self.growths = (*self.growths, grown)[-RECENT_TURNS:]
            self.tokens += GENERATION_PROMPT_TOKENS + c.answer_tokens + END_OF_TURN_TOKENS

    def _think(self) -> float:
        """The agent's time in its tools (or the user's) before its next turn."""
        c = self.config
        if c.tool_model == "codex":
            return CODEX.draw(self.rng)
        return self.rng.expovariate(1 / c.think_s) if c.think_s else 0.0

    def _state(self) -> Background:
        """The session's background run as the service's turn policy sees it."""
        if self.background is None:
            return "absent"
        if not self.background.ready.triggered:
            return "running"
        done = cast(CompactionOutcome, self.background.ready.value)
        return "done" if done.admitted else "failed"

    def _start_background(self, observation: int) -> None:
        env, c = self.cluster.env, self.config
        job = self.job(self.tokens, observation, BACKGROUND if c.yielding else AGENT)
        compaction = env.process(self.cluster.compact(job))
        ready = env.process(self._warm(compaction)) if c.warm else compaction
        self.background = _Background(job, self.tokens, compaction, ready)

    def _warm(self, compaction: simpy.Process) -> Generator[simpy.Event, Any, CompactionOutcome]:
        """The background result, once its compacted prompt is prefilled on the home replica (next epoch's chain)."""
        outcome = yield compaction
        if outcome.admitted:
            tokens = self.compacted_tokens(outcome)
            home, namespace = self.cluster.home(self.id), (self.id, self.epoch + 1)
            priority = BACKGROUND if self.config.yielding else AGENT
            warm = self.cluster.submit(home, tokens, 0, namespace, tokens, kind="warm", priority=priority)
            yield warm.done
        return outcome

    def _compact(self, observation: int, recorder: Recorder) -> Generator[simpy.Event, Any, None]:
        env, c = self.cluster.env, self.config
        waited_from = env.now
        outcome: CompactionOutcome | None = None
        snapshot = self.tokens
        if self.background is not None:
            snapshot = self.background.snapshot
            if not self.background.compaction.triggered:
                self.cluster.escalate(self.background.job)
            outcome = yield self.background.compaction
            if outcome is not None and outcome.admitted:
                recorder.background_used += 1
            else:
                recorder.refused += 1
                outcome = None  # fall back to a blocking compaction now
        while outcome is None or not outcome.admitted:
            if outcome is not None:
                recorder.refused += 1
                yield env.timeout(c.retry_after_s)
            snapshot = self.tokens
            outcome = yield env.process(self.cluster.compact(self.job(snapshot, observation)))
        recorder.stalls.append(env.now - waited_from)
        self.cluster.replicas[self.cluster.home(self.id)].cache.drop(self.namespace)
        self.tokens = self.compacted_tokens(outcome) + (self.tokens - snapshot)
        self.epoch += 1
        self.background = None
