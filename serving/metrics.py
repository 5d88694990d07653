"""Every metric the service exports, in one module: `ray.util.metrics` objects on Ray's metrics endpoint.

Ray exports each under `ray_<name>` (counters also get `_total`) on every node's metrics port, with
its own tags (`WorkerId`, `NodeAddress`, ...) besides ours; sum over them for service-wide figures:

    curl -s http://127.0.0.1:<metrics port>/metrics | grep '^ray_compaction_'

`SPECS` is the list (the table in docs/service.md and cluster/grafana-compaction.json follow it). The
coordinator records through `RayMetrics` (a `Sink`), chunk summaries reused from the cache
included; the chat path records the agent's stall with `record_stall`. Metric objects are created
on first use in each process, since Ray metrics belong to the worker that records them. Importing
this module imports no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from compaction.result import CompactionStats
from serving.admission import GateState

Kind = Literal["counter", "gauge", "histogram"]
OutcomeKind = Literal["ok", "invalid", "overloaded", "failed", "timeout", "cancelled"]
SECONDS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CHUNKS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # exported as ray_<name>
    kind: Kind
    description: str
    tags: tuple[str, ...]
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "compaction_requests",
        "counter",
        "Compaction requests answered, by outcome: ok, invalid (4xx), overloaded (429), failed (503), "
        "timeout (504: past timeout_s), cancelled (the client left).",
        ("model", "strategy", "outcome"),
    ),
    MetricSpec(
        "compaction_latency_seconds",
        "histogram",
        "Run time of a successful compaction (queue wait excluded).",
        ("model", "strategy"),
        SECONDS,
    ),
    MetricSpec(
        "compaction_queue_wait_seconds", "histogram", "Time a compaction waited for admission.", ("model",), SECONDS
    ),
    MetricSpec("compaction_queue_depth", "gauge", "Compactions waiting for admission (per coordinator).", ("model",)),
    MetricSpec("compaction_running", "gauge", "Compactions running (per coordinator).", ("model",)),
    MetricSpec(
        "compaction_running_sequences",
        "gauge",
        "Chunk prompts the running compactions may keep in flight, against the admission capacity (per coordinator).",
        ("model",),
    ),
    MetricSpec("compaction_chunks", "histogram", "Chunks per successful compaction.", ("model", "strategy"), CHUNKS),
    MetricSpec(
        "compaction_prompt_tokens",
        "counter",
        "Prompt tokens of the chunk prompts by source: computed (prefilled) or cached (served from the prefix cache).",
        ("model", "source"),
    ),
    MetricSpec(
        "compaction_input_tokens",
        "counter",
        "History tokens compacted; its rate is the compaction throughput.",
        ("model",),
    ),
    MetricSpec(
        "compaction_chunk_retries",
        "counter",
        "Chunk prompts sent again because the first summary was empty, a runaway, an echo or ungrounded.",
        ("model",),
    ),
    MetricSpec(
        "compaction_failovers", "counter", "Chunk prompts moved to another model replica after a failure.", ("model",)
    ),
    MetricSpec(
        "compaction_bad_chunks",
        "counter",
        "Chunks whose first summary was not kept as it came, by what was kept: retried, runaway_trimmed, "
        "kept_verbatim, extractive_fallback.",
        ("model", "status"),
    ),
    MetricSpec(
        "compaction_deduplicated",
        "counter",
        "Requests that joined an identical running compaction of the same session instead of starting one.",
        ("model",),
    ),
    MetricSpec(
        "compaction_coordinator_retries",
        "counter",
        "Ingress calls sent again to another coordinator replica after one died or was unreachable.",
        ("method",),
    ),
    MetricSpec(
        "compaction_stall_seconds",
        "histogram",
        "How long an agent's chat turn waited for compaction (server-side compaction in /v1/chat/completions).",
        ("model",),
        SECONDS,
    ),
    MetricSpec(
        "compaction_recall_requests",
        "counter",
        "Calls to the archive's MCP endpoint (/mcp) by what was asked: tools/list, recall, search_history.",
        ("method",),
    ),
    MetricSpec(
        "compaction_reused_chunks",
        "counter",
        "Chunk summaries served from the chunk-summary cache instead of being generated again.",
        ("model",),
    ),
)
_BY_NAME = {spec.name: spec for spec in SPECS}
_objects: dict[str, Any] = {}  # this process's Ray metric objects, created on first use


def _metric(name: str) -> Any:
    if name not in _objects:
        from ray.util import metrics

        spec = _BY_NAME[name]
        if spec.kind == "counter":
            _objects[name] = metrics.Counter(name, spec.description, spec.tags)
        elif spec.kind == "gauge":
            _objects[name] = metrics.Gauge(name, spec.description, spec.tags)
        else:
            _objects[name] = metrics.Histogram(name, spec.description, list(spec.boundaries), spec.tags)
    return _objects[name]


def _inc(name: str, value: float, **tags: str) -> None:
    if value > 0:
        _metric(name).inc(value, tags=tags)


def record_stall(model: str, seconds: float) -> None:
    """An agent's chat turn waited `seconds` for compaction (0 when a background result was ready)."""
    _metric("compaction_stall_seconds").observe(max(0.0, seconds), tags={"model": model})


def record_reused_chunks(model: str, count: int) -> None:
    """`count` chunk summaries came from the chunk-summary cache."""
    _inc("compaction_reused_chunks", count, model=model)


def record_recall(method: str) -> None:
    """An agent asked the archive's MCP endpoint for `method`."""
    _inc("compaction_recall_requests", 1, method=method)


def record_coordinator_retry(method: str) -> None:
    """The ingress sent a call to another coordinator replica after one failed."""
    _inc("compaction_coordinator_retries", 1, method=method)


@dataclass(frozen=True)
class Outcome:
    """How one compaction request ended, as the coordinator reports it."""

    model: str
    strategy: str
    outcome: OutcomeKind
    queue_wait_s: float | None = None  # None when it never queued (refused before admission)
    stats: CompactionStats | None = None  # the run's stats, for successful compactions
    joined: bool = False  # it shared an identical running compaction


class Sink(Protocol):
    """Where the coordinator reports; `RayMetrics` in the service, a list in tests."""

    def compaction(self, outcome: Outcome) -> None: ...

    def queue(self, model: str, state: GateState) -> None: ...


class RayMetrics:
    """The coordinator's `Sink` on Ray's metrics."""

    def compaction(self, outcome: Outcome) -> None:
        model, strategy = outcome.model, outcome.strategy
        _inc("compaction_requests", 1, model=model, strategy=strategy, outcome=outcome.outcome)
        if outcome.joined:
            _inc("compaction_deduplicated", 1, model=model)
        if outcome.queue_wait_s is not None and not outcome.joined:
            _metric("compaction_queue_wait_seconds").observe(outcome.queue_wait_s, tags={"model": model})
        stats = outcome.stats
        if stats is None or outcome.joined:
            return
        _metric("compaction_latency_seconds").observe(stats.latency_s, tags={"model": model, "strategy": strategy})
        _metric("compaction_chunks").observe(stats.chunks, tags={"model": model, "strategy": strategy})
        _inc("compaction_prompt_tokens", stats.computed_prefill_tokens, model=model, source="computed")
        _inc("compaction_prompt_tokens", stats.cached_prompt_tokens, model=model, source="cached")
        _inc("compaction_input_tokens", stats.input_tokens, model=model)
        _inc("compaction_chunk_retries", stats.retries, model=model)
        _inc("compaction_failovers", stats.failovers, model=model)
        record_reused_chunks(model, stats.reused_chunks)
        for chunk in stats.per_chunk:
            if chunk.status != "ok":
                _inc("compaction_bad_chunks", 1, model=model, status=chunk.status)

    def queue(self, model: str, state: GateState) -> None:
        _metric("compaction_queue_depth").set(state.queued, tags={"model": model})
        _metric("compaction_running").set(state.running, tags={"model": model})
        _metric("compaction_running_sequences").set(state.running_sequences, tags={"model": model})
