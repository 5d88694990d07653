"""One simulated run's configuration (`SimConfig`: a deployment, a fleet of agents, a compaction policy) and the
agent streams a session draws its turns from (in tokens)."""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compaction.options import CompactionOptions, Layout, Strategy
from compaction.turn_policy import ContextManagement
from serving.routing import PlacementMode

Mode = Literal["blocking", "background"]
Dataset = Literal["locomo", "hotpotqa", "synthetic"]
SUMMARY_HEADER_TOKENS = 16  # the user turn that carries the merged summary


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
    apply_background: Literal["ready", "threshold", "rolling"] = Field(
        "ready",
        description="background mode: a finished run is applied at the next turn, or only at tau; rolling: chunks "
        "are summarised as they become final and the compaction at tau (blocking's) takes them.",
    )
    warm: bool = Field(True, description="background mode: a finished run's compacted prompt is prefilled on home.")
    strategy: Strategy = Field("parallel", description="parallel (chunked) or sequential compaction.")
    chunk_tokens: int = Field(4096, ge=16, le=1_048_576, description="B, the chunk size (parallel).")
    layout: Layout = Field("prefix_exact", description="Chunk prompt layout.")
    summary_tokens: int = Field(
        2048, ge=16, le=65_536, description="Decode volume of one compaction, split evenly over its chunks."
    )
    summary_text_tokens: int | None = Field(
        None,
        ge=0,
        le=65_536,
        description="Tokens the merged summary adds to the prompt (None: summary_tokens, what was decoded); the "
        "service's merge adds the user's own words and extractive text, so the two can differ.",
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
    retry_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of chunk prompts whose first summary fails its checks (empty, runaway, echo, ungrounded) "
        "and is asked again, strictly, once it is done: that chunk decodes twice, one attempt after the other.",
    )
    seed: int = Field(0, ge=0, description="Random seed of arrivals, think times and stream offsets.")

    @model_validator(mode="after")
    def _compaction_shrinks(self) -> SimConfig:
        if self.system_tokens + self.summary_tokens + self.keep_recent_tokens + SUMMARY_HEADER_TOKENS >= self.tau // 2:
            raise ValueError(
                f"summary_tokens + keep_recent_tokens + system_tokens must stay under tau/2 ({self.tau // 2}); "
                "otherwise compactions would follow each other; lower them or raise tau"
            )
        return self

    def summary_text(self) -> int:
        return self.summary_tokens if self.summary_text_tokens is None else self.summary_text_tokens

    def options(self) -> CompactionOptions:
        return CompactionOptions(strategy=self.strategy, chunk_tokens=self.chunk_tokens, layout=self.layout)

    def entry(self) -> ContextManagement:
        """The context_management entry the service would be sent for this run's compaction policy."""
        background = int(self.background_share * self.tau) if self.mode == "background" else None
        return ContextManagement(
            type="compaction", compact_threshold=self.tau, background_threshold=background,
            keep_recent_tokens=self.keep_recent_tokens, apply_background=self.apply_background,
        )  # fmt: skip


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
