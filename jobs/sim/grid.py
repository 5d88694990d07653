"""Simulation grids: a YAML of a base configuration and axes, one Parquet row per finished cell.

    name: h100-fleet
    base: {profile: h100-llama-3.1-8b, duration_s: 600}
    axes: {replicas: [8, 16, 64], sessions: [100, 1000, 5000], policy: [pinned, spread, round_robin, auto]}

Cells are written with the sweep's `ResultStore` (atomic files, a re-run skips finished cells) under a fixed schema:
every `SimConfig` field plus the figures of `jobs.sim.runner.summarise`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compaction.errors import InvalidInput
from jobs.bench.common import sayer
from jobs.experiments.results import ResultStore
from jobs.sim.config import SimConfig
from jobs.sim.runner import simulate

METRICS: dict[str, pa.DataType] = {
    "model": pa.string(), "hardware": pa.string(), "turns": pa.int64(), "turn_latency_mean_s": pa.float64(),
    "turn_latency_p50_s": pa.float64(), "turn_latency_p95_s": pa.float64(), "compactions": pa.int64(),
    "refused": pa.int64(),
    "background_used": pa.int64(), "rolled_chunks": pa.int64(), "rolled_taken": pa.int64(),
    "compaction_latency_mean_s": pa.float64(),
    "compaction_latency_p50_s": pa.float64(), "compaction_latency_p95_s": pa.float64(),
    "queue_wait_mean_s": pa.float64(), "stall_total_s": pa.float64(), "stall_mean_s": pa.float64(),
    "stall_p95_s": pa.float64(), "compaction_share": pa.float64(), "e2e_per_turn_s": pa.float64(),
    "compaction_throughput_tok_s": pa.float64(), "prompt_tokens": pa.int64(), "computed_prefill_tokens": pa.int64(),
    "cache_hit_share": pa.float64(), "compaction_cache_hit_share": pa.float64(), "replica_utilisation": pa.float64(),
    "mean_batch": pa.float64(), "spread_share": pa.float64(), "evicted_tokens": pa.int64(), "sim_wall_s": pa.float64(),
}  # fmt: skip


def _arrow(annotation: Any) -> pa.DataType:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return _arrow(args[0])
    if typing.get_origin(annotation) is typing.Literal or annotation is str:
        return pa.string()
    return {int: pa.int64(), float: pa.float64(), bool: pa.bool_()}[annotation]


SCHEMA = pa.schema(
    [pa.field("cell_id", pa.string(), nullable=False), pa.field("grid", pa.string(), nullable=False)]
    + [pa.field(name, _arrow(f.annotation)) for name, f in SimConfig.model_fields.items()]
    + [pa.field(name, kind) for name, kind in METRICS.items()]
)


class SimGrid(BaseModel):
    """A base configuration and the axes to sweep; every axis is a SimConfig field."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]+$", description="Names the grid and its default results folder.")
    description: str = Field("", description="What the grid answers.")
    base: dict[str, Any] = Field(default_factory=dict, description="SimConfig fields shared by every cell.")
    axes: dict[str, list[Any]] = Field(default_factory=dict, description="SimConfig field -> values to sweep.")

    @model_validator(mode="after")
    def _fields(self) -> SimGrid:
        unknown = sorted((set(self.base) | set(self.axes)) - set(SimConfig.model_fields))
        if unknown:
            raise ValueError(f"not SimConfig fields: {unknown}; known: {sorted(SimConfig.model_fields)}")
        if any(not values for values in self.axes.values()):
            raise ValueError("every axis needs at least one value")
        return self

    def cells(self) -> list[SimConfig]:
        names = list(self.axes)
        return [
            SimConfig.model_validate({**self.base, **dict(zip(names, values, strict=True))})
            for values in itertools.product(*(self.axes[n] for n in names))
        ]


def cell_id(config: SimConfig) -> str:
    digest = hashlib.sha256(json.dumps(config.model_dump(), sort_keys=True).encode()).hexdigest()[:10]
    return (
        f"{config.profile}-r{config.replicas}-s{config.sessions}-{config.policy}-{config.mode}-t{config.tau}-{digest}"
    )


def load_grid(path: str | Path) -> SimGrid:
    file = Path(path)
    try:
        return SimGrid.model_validate(yaml.safe_load(file.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput("config", f"cannot read {file}: {exc}") from exc
    except ValidationError as exc:
        raise InvalidInput("config", f"{file} is invalid: {exc}") from exc


say = sayer("simulate", clock=True)


def run_grid(
    grid: SimGrid, results: Path, run: Callable[[SimConfig], dict[str, Any]] = simulate, quiet: bool = False
) -> ResultStore:
    """Run every cell not yet in `results`; one Parquet file per cell."""
    store = ResultStore(results, SCHEMA)
    cells = grid.cells()
    done = store.done()
    todo = [c for c in cells if cell_id(c) not in done]
    if not quiet:
        say(f"{grid.name}: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run")
    for index, config in enumerate(todo, 1):
        row = {"cell_id": cell_id(config), "grid": grid.name, **run(config)}
        store.write(row["cell_id"], pa.Table.from_pylist([row], schema=SCHEMA))
        if not quiet:
            say(
                f"{index}/{len(todo)} {row['cell_id']}: stall {row['stall_mean_s']:.1f} s/compaction, "
                f"{row['compactions']} compactions, {row['sim_wall_s']:.0f} s"
            )
    return store
