"""Sweep configuration: a pydantic-validated YAML grid, expanded into cells with stable ids.

A cell is one unit of work and one atomic result file: one compaction of a fixed snapshot
(`summary` experiments: output length, stability), one agent run over a dataset stream (`agent`
experiments: τ and chunking sweeps, QA quality), or one compaction of a history with known
content (`retention` experiments: which planted facts or QA evidence survive, and whether the
summary invented anything). Its id hashes every parameter that changes its result, so a re-run
recognises what is already done.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compaction.errors import InvalidInput
from compaction.options import GROUNDING_THRESHOLD, CompactionOptions, Layout, Strategy, Variant
from jobs.agent.chat_loop import ChatMode
from jobs.agent.judge import pick_judge
from jobs.agent.tools import ToolTime
from serving.models import Catalogue

Kind = Literal["summary", "agent", "retention", "chat_agent"]
DatasetName = Literal["hotpotqa", "locomo", "locomo_mc", "coding", "analysis"]
GENERATED: frozenset[str] = frozenset({"coding", "analysis"})  # made by jobs.data generators, no file to read
# Layouts whose prompts carry the history before the chunk: they need the whole snapshot within the window.
WINDOWED_LAYOUTS = frozenset({"sequential", "prefix_exact", "prefix_exact_marked", "paper", "shared_full"})
FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


BACKGROUND_MODES = ("background_parallel", "rolling_parallel")  # chat_agent modes with a background_threshold


class DataPaths(BaseModel):
    """Benchmark files; relative paths are read from the data folder (--data-dir)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hotpotqa: str = Field("hotpotqa_dev_distractor_sample100.json", description="HotpotQA original-format JSON.")
    locomo: str = Field("locomo10.json", description="LoCoMo locomo10.json.")
    locomo_mc: str | None = Field(None, description="LoCoMo-MC10 JSONL; null uses the small bundled fixture.")

    def resolve(self, data_dir: Path) -> dict[str, str]:
        paths = {"hotpotqa": self.hotpotqa, "locomo": self.locomo}
        out = {name: str(data_dir / p if not Path(p).is_absolute() else Path(p)) for name, p in paths.items()}
        mc = self.locomo_mc
        out["locomo_mc"] = str(FIXTURES / "locomo_mc10_tiny.jsonl") if mc is None else str(data_dir / mc)
        return out


class BackendConfig(BaseModel):
    """Where the models run: an engine per model in a Ray actor, or a running OpenAI-compatible service."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["engine", "service"] = Field("engine", description="engine: vLLM in a Ray actor; service: HTTP.")
    base_url: str | None = Field(None, description="service: the app's URL (it serves /v1/completions).")
    max_model_len: int | None = Field(None, ge=512, le=1_048_576, description="engine: window (default: catalogue).")
    kv_cache_gib: int = Field(1, ge=1, le=512, description="engine on CPU: KV cache size in GiB.")
    engine_cpus: float = Field(1.0, gt=0, le=64, description="engine: logical CPUs of the engine actor.")
    engine_gpus: float = Field(0.0, ge=0, le=8, description="engine: GPUs of the engine actor.")

    @model_validator(mode="after")
    def _service_url(self) -> BackendConfig:
        if self.kind == "service" and not self.base_url:
            raise ValueError("backend.kind=service needs backend.base_url")
        return self


class Experiment(BaseModel):
    """One block of the grid; every list is a sweep axis."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-z0-9_]+$", description="Block name; prefixes its cells' ids.")
    kind: Kind = Field(
        description="summary: compact a fixed snapshot; agent: run the agent over a stream; retention: compact a "
        "history with known facts (coding traces, LoCoMo QA evidence) and measure what survives; chat_agent: the "
        "agent through a running service's /v1/chat/completions, compacted server-side (backend: service)."
    )
    datasets: list[DatasetName] = Field(
        min_length=1,
        description="summary: LoCoMo only; retention: coding, analysis (generated agent sessions) and/or locomo; "
        "agent: the QA sets.",
    )
    strategies: list[Strategy] = Field(["parallel"], min_length=1)
    chunk_tokens: list[int] = Field([2048], min_length=1, description="Chunk sizes B (parallel only).")
    layouts: list[Layout] = Field(["prefix_exact"], min_length=1, description="Chunk prompt layouts (parallel).")
    variants: list[Variant] = Field(["default"], min_length=1)
    taus: list[int] | None = Field(None, description="agent, chat_agent: compaction thresholds τ in tokens.")
    modes: list[ChatMode] | None = Field(
        None,
        description="chat_agent: none, blocking_sequential, blocking_parallel, background_parallel, rolling_parallel.",
    )
    background_share: float = Field(
        0.625, gt=0, lt=1, description="chat_agent: background_threshold of the background modes, as a share of τ."
    )
    tool_time: str = Field(
        "codex",
        description="chat_agent: the agent's tool time after each turn: codex (a fit to real Codex tool calls, "
        "jobs.agent.tools; drawn per repeat) or a number of seconds (0: back to back).",
    )
    input_tokens: list[int] | None = Field(None, description="summary, retention: history sizes in tokens.")
    grounding_thresholds: list[float] | None = Field(
        None,
        min_length=1,
        description=f"Grounding thresholds of the summaries (0..1; 0 = no check). Default {GROUNDING_THRESHOLD}.",
    )
    repeats: int = Field(
        1,
        ge=1,
        le=100,
        description="Runs of each cell's parameters (repeat index 0..n-1); retention: the trace seed, or the "
        "LoCoMo conversation counted from sample_id.",
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Summary sampling temperature (>0 for stability).")
    summary_tokens: int = Field(256, ge=16, le=65_536, description="Output budget of one whole compaction.")
    fixed_output_tokens: bool = Field(False, description="Every summary emits exactly its budget (matched volume).")
    retry_bad_summaries: bool = Field(True, description="Retry empty or runaway chunk summaries once.")
    answer_tokens: int = Field(32, ge=1, le=4096, description="agent: output budget of one answer.")
    limit: int | None = Field(None, ge=1, description="agent: examples (HotpotQA), sessions (LoCoMo) or rows (MC).")
    questions_per_document: int | None = Field(None, ge=1, description="agent, LoCoMo: questions after a session.")
    sample_id: str | None = Field(None, description="LoCoMo conversation (default: the first).")
    judge: bool = Field(True, description="agent, retention: grade free-form answers with the LLM judge.")
    concurrency: int = Field(1, ge=1, le=64, description="Cells of this block run at once per model (1 = timed).")
    option_sets: dict[str, dict[str, Any]] | None = Field(
        None,
        description="retention: named sets of compaction options, an axis of the block (e.g. {default: {}, "
        "baseline: {pinned_share: 0}}); the name is the rows' option_set. None: the defaults alone.",
    )

    @model_validator(mode="after")
    def _axes(self) -> Experiment:
        if self.kind in ("agent", "chat_agent") and not self.taus:
            raise ValueError(f"{self.name}: an {self.kind} experiment needs taus")
        if (self.kind == "chat_agent") != bool(self.modes):
            raise ValueError(f"{self.name}: modes are for chat_agent experiments, which need them")
        if self.kind == "chat_agent" and not set(self.datasets) <= {"locomo", "hotpotqa"}:
            raise ValueError(f"{self.name}: chat_agent experiments read LoCoMo or HotpotQA")
        ToolTime.parse(self.tool_time)  # a ValueError naming the problem becomes the config's validation error
        if self.kind in ("summary", "retention") and not self.input_tokens:
            raise ValueError(f"{self.name}: a {self.kind} experiment needs input_tokens")
        if self.kind == "summary" and self.datasets != ["locomo"]:
            raise ValueError(f"{self.name}: summary experiments compact LoCoMo conversations (datasets: [locomo])")
        if self.kind == "retention" and not set(self.datasets) <= {"locomo", *GENERATED}:
            raise ValueError(f"{self.name}: retention experiments read coding and analysis traces and LoCoMo")
        if self.kind != "retention" and GENERATED & set(self.datasets):
            raise ValueError(f"{self.name}: coding and analysis traces are for retention experiments")
        if self.option_sets and self.kind != "retention":
            raise ValueError(f"{self.name}: option_sets are for retention experiments")
        for name, overrides in (self.option_sets or {}).items():
            try:
                CompactionOptions.model_validate(overrides)
            except ValidationError as exc:
                raise ValueError(f"{self.name}: option_sets.{name}: {exc.errors()[0]['msg']}") from exc
        if any(not 0 <= t <= 1 for t in self.grounding_thresholds or []):
            raise ValueError(f"{self.name}: grounding_thresholds must lie in [0, 1]")
        return self


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]+$", description="Names the default results folder.")
    description: str = ""
    models: list[str] = Field(min_length=1, description="Agent models (catalogue names).")
    judges: list[str] = Field(default_factory=list, description="Judge preference; the first that is not the agent.")
    backend: BackendConfig = Field(default_factory=BackendConfig)
    data: DataPaths = Field(default_factory=DataPaths)
    window_headroom_tokens: int = Field(
        1024, ge=0, le=65_536, description="Room kept above τ (or the snapshot) for a document, tails and output."
    )
    experiments: list[Experiment] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> SweepConfig:
        names = [e.name for e in self.experiments]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment names repeat: {names}")
        chat = [e.name for e in self.experiments if e.kind == "chat_agent"]
        if chat and self.backend.kind != "service":
            raise ValueError(f"{chat}: chat_agent experiments run against the service (backend: kind: service)")
        return self

    def check_models(self, catalogue: Catalogue) -> None:
        for name in [*self.models, *self.judges]:
            catalogue.get(name)  # raises UnknownModel naming the hosted ones


class Cell(BaseModel):
    """Every parameter of one unit of work."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    experiment: str
    kind: Kind
    model: str
    judge_model: str | None
    dataset: DatasetName
    strategy: Strategy
    chunk_tokens: int | None  # None when sequential
    layout: str  # "sequential" when sequential
    variant: Variant
    tau: int | None
    input_tokens: int | None
    summary_tokens: int
    answer_tokens: int
    temperature: float
    fixed_output_tokens: bool
    retry_bad_summaries: bool
    repeat: int
    limit: int | None
    questions_per_document: int | None
    sample_id: str | None
    grounding_threshold: float | None = None  # None: the option's default (and ids of older cells unchanged)
    mode: ChatMode | None = None  # chat_agent: how the service compacts (None elsewhere; ids unchanged)
    background_threshold: int | None = None  # chat_agent, background_parallel: the soft threshold
    tool_time: str | None = None  # chat_agent: jobs.agent.tools.ToolTime spec
    option_set: str | None = None  # retention: the name of the cell's option set (None: the defaults)
    overrides: dict[str, Any] | None = None  # its compaction options

    @property
    def cell_id(self) -> str:
        optional = ("grounding_threshold", "mode", "background_threshold", "tool_time", "option_set", "overrides")
        params = {k: v for k, v in self.model_dump().items() if k not in optional or v is not None}
        digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
        shape = {"sequential": "seq", "extractive": f"ext{self.chunk_tokens}"}.get(
            self.strategy, f"par{self.chunk_tokens}"
        )
        size = f"tau{self.tau}" if self.tau is not None else f"in{self.input_tokens}"
        threshold = "" if self.grounding_threshold is None else f"-g{self.grounding_threshold:g}"
        where = self.dataset if self.mode is None else f"{self.dataset}-{self.mode}"
        where += f"-{self.option_set}" if self.option_set else ""
        return f"{self.experiment}-{where}-{shape}-{size}-{self.variant}{threshold}-r{self.repeat}-{digest}"

    def compaction_options(self) -> CompactionOptions:
        parallel = self.strategy == "parallel"
        threshold = {} if self.grounding_threshold is None else {"grounding_threshold": self.grounding_threshold}
        summaries_only = {"clearing": "off", "ledger_tokens": 0}  # the sweep compares the summaries (unless overridden)
        return CompactionOptions(
            **{**summaries_only, **(self.overrides or {})},
            **threshold,
            strategy=self.strategy,
            chunk_tokens=self.chunk_tokens or CompactionOptions.model_fields["chunk_tokens"].default,
            layout=self.layout if parallel else "prefix_exact",
            variant=self.variant,
            max_chunk_summary_tokens=min(self.summary_tokens, 32_768),
            temperature=self.temperature,
            retry_bad_summaries=self.retry_bad_summaries,
            fixed_output_tokens=self.fixed_output_tokens,
        )


class Expansion(BaseModel):
    cells: list[Cell]
    dropped: list[tuple[Cell, str]] = Field(description="Cells that cannot run, with the reason.")


Shape = tuple[ChatMode | None, Strategy, int | None, str]  # (chat mode, strategy, chunk, layout)


def _shapes(e: Experiment) -> list[Shape]:
    """(mode, strategy, chunk, layout) combinations; sequential has no chunk size or layout, extractive no layout.

    chat_agent blocks cross their modes with the chunk sizes; the mode sets the strategy.
    """
    if e.kind == "chat_agent":
        modes = e.modes or []
        shapes: list[Shape] = [(m, "sequential", None, "sequential") for m in modes if m == "blocking_sequential"]
        shapes += [(m, "parallel", None, "none") for m in modes if m == "none"]
        parallel = [m for m in modes if m.endswith("_parallel")]
        return shapes + [(m, "parallel", b, "prefix_exact") for m in parallel for b in e.chunk_tokens]
    return [(None, *shape) for shape in _compaction_shapes(e)]


def _compaction_shapes(e: Experiment) -> list[tuple[Strategy, int | None, str]]:
    out: list[tuple[Strategy, int | None, str]] = []
    for strategy in e.strategies:
        if strategy == "sequential":
            out.append(("sequential", None, "sequential"))
        elif strategy == "extractive":
            out += [("extractive", b, "extractive") for b in e.chunk_tokens]
        else:
            out += [("parallel", b, layout) for b in e.chunk_tokens for layout in e.layouts]
    return out


def expand(config: SweepConfig, catalogue: Catalogue) -> Expansion:
    """Every cell of the grid, in config order; cells whose size does not fit the model's window are dropped."""
    config.check_models(catalogue)
    cells: list[Cell] = []
    dropped: list[tuple[Cell, str]] = []
    for e in config.experiments:
        agentic = e.kind in ("agent", "chat_agent")
        sizes = e.taus if agentic else e.input_tokens
        thresholds: list[float | None] = [*e.grounding_thresholds] if e.grounding_thresholds else [None]
        sets: list[tuple[str | None, dict[str, Any] | None]] = [*(e.option_sets or {}).items()] or [(None, None)]
        axes = itertools.product(
            config.models, e.datasets, _shapes(e), sizes or [], e.variants, thresholds, sets, range(e.repeats)
        )
        for model, dataset, (mode, strategy, chunk, layout), size, variant, threshold, options, repeat in axes:
            judged = config.judges and e.kind != "summary" and e.judge
            judge = pick_judge(model, config.judges) if judged else None
            cell = Cell(
                experiment=e.name,
                kind=e.kind,
                model=model,
                judge_model=judge,
                dataset=dataset,
                strategy=strategy,
                chunk_tokens=chunk,
                layout=layout,
                variant=variant,
                tau=size if agentic else None,
                input_tokens=size if not agentic else None,
                summary_tokens=e.summary_tokens,
                answer_tokens=e.answer_tokens,
                temperature=e.temperature,
                fixed_output_tokens=e.fixed_output_tokens,
                retry_bad_summaries=e.retry_bad_summaries,
                repeat=repeat,
                limit=e.limit,
                questions_per_document=e.questions_per_document,
                sample_id=e.sample_id,
                grounding_threshold=threshold,
                mode=mode,
                background_threshold=int(size * e.background_share) if mode in BACKGROUND_MODES else None,
                tool_time=e.tool_time if e.kind == "chat_agent" else None,
                option_set=options[0],
                overrides=options[1],
            )
            window = config.backend.max_model_len or catalogue.get(model).max_model_len
            need = size + e.summary_tokens + config.window_headroom_tokens
            if need > window and (e.kind != "retention" or layout in WINDOWED_LAYOUTS):
                dropped.append((cell, f"needs {need} tokens ({size} + summary + headroom), over {model}'s {window}"))
            else:
                cells.append(cell)
    return Expansion(cells=cells, dropped=dropped)


def load_config(path: str | Path) -> SweepConfig:
    file = Path(path)
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput("config", f"cannot read {file}: {exc}") from exc
    try:
        return SweepConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise InvalidInput("config", f"{file}: {where}: {first['msg']}") from exc
