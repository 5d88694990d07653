"""The results dataset: one fixed Arrow schema, one Parquet file per finished cell, written atomically.

A cell's rows are written to a hidden temporary file in the same folder and renamed into place
(`os.replace` is atomic on one file system), so a crash leaves either the whole cell or nothing,
never partial rows. A re-run skips every cell whose file exists. Only the driver writes.
Hidden files (leading `.`) are ignored by Arrow's dataset discovery, so a leftover temporary
file is never read.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from compaction.result import CompactionStats

_I = pa.int32()
_F = pa.float64()
_S = pa.string()
_B = pa.bool_()

# event: "summary" (one compaction of a fixed snapshot), "turn" (one agent step), "episode" (an agent run's totals),
# "retention" (one compaction of a history with known facts), "fact" (one known fact of it).
SCHEMA = pa.schema(
    [
        # identity of the cell (every row)
        pa.field("cell_id", _S, nullable=False),
        pa.field("experiment", _S, nullable=False),
        pa.field("kind", _S, nullable=False),
        pa.field("event", _S, nullable=False),
        pa.field("model", _S, nullable=False),
        pa.field("dataset", _S, nullable=False),
        pa.field("strategy", _S, nullable=False),
        pa.field("layout", _S, nullable=False),
        pa.field("variant", _S, nullable=False),
        pa.field("chunk_tokens", _I),
        pa.field("tau", _I),
        pa.field("target_input_tokens", _I),
        pa.field("summary_budget", _I, nullable=False),
        pa.field("fixed_output_tokens", _B, nullable=False),
        pa.field("temperature", _F, nullable=False),
        pa.field("repeat", _I, nullable=False),
        pa.field("backend", _S, nullable=False),
        pa.field("cold_start", _B, nullable=False),
        pa.field("mode", _S),  # chat_agent: none, blocking_sequential, blocking_parallel, background_parallel
        pa.field("option_set", _S),  # retention: the named set of compaction options (None: the defaults)
        # one agent turn
        pa.field("turn_index", _I),
        pa.field("step", _S),
        pa.field("label", _S),
        pa.field("context_tokens", _I),
        pa.field("tokens_after", _I),
        pa.field("answer_prompt_tokens", _I),
        pa.field("answer_cached_tokens", _I),
        pa.field("answer_output_tokens", _I),
        pa.field("answer_latency_s", _F),
        pa.field("compaction_stall_s", _F),
        pa.field("tool_s", _F),  # chat_agent: the agent's tool time after the turn (episode rows: in all)
        pa.field("compaction_status", _S),  # chat_agent: applied, running or none
        pa.field("compaction_source", _S),  # chat_agent, applied: background or blocking
        pa.field("reused_chunks", _I),  # chunk summaries reused from the chunk cache
        # one compaction (summary rows; turn rows that compacted)
        pa.field("compacted", _B),
        pa.field("history_tokens", _I),
        pa.field("input_tokens", _I),
        pa.field("chunks", _I),
        pa.field("prompt_tokens", _I),
        pa.field("cached_prompt_tokens", _I),
        pa.field("computed_prefill_tokens", _I),
        pa.field("prefill_floor_tokens", _I),
        pa.field("output_tokens", _I),
        pa.field("summary_tokens", _I),
        pa.field("compacted_tokens", _I),
        pa.field("compaction_latency_s", _F),
        pa.field("retries", _I),
        pa.field("bad_chunks", _I),
        pa.field("user_words_kept", _I),  # user messages kept verbatim in the compacted head
        pa.field("user_words_tokens", _I),
        pa.field("pinned_lines", _I),  # chunk lines kept word for word beside the summaries
        pa.field("repeated_sentences", _I),  # sentences of the kept summary that repeat an earlier one
        pa.field("summary_text", _S),
        # grounding of one compaction (retention rows): first model attempts vs the kept texts
        pa.field("grounding_threshold", _F),
        pa.field("model_summaries", _I),
        pa.field("summaries_ungrounded_first", _I),
        pa.field("summaries_ungrounded_out", _I),
        pa.field("salient_tokens_first", _I),
        pa.field("ungrounded_tokens_first", _I),
        pa.field("salient_tokens_out", _I),
        pa.field("ungrounded_tokens_out", _I),
        pa.field("ungrounded_chunks", _I),
        pa.field("fallback_chunks", _I),
        pa.field("dropped_sentences", _I),
        # recall of known facts (retention rows: totals; fact rows: one fact, with question/gold/prediction/judge)
        pa.field("facts", _I),
        pa.field("recall_exact", _F),
        pa.field("recall_judged", _F),
        pa.field("fact_index", _I),
        pa.field("fact_kind", _S),
        pa.field("recalled_exact", _B),
        # one question
        pa.field("task_id", _S),
        pa.field("category", _S),
        pa.field("question", _S),
        pa.field("gold", _S),
        pa.field("prediction", _S),
        pa.field("em", _F),
        pa.field("f1", _F),
        pa.field("mc_correct", _B),
        pa.field("judge_model", _S),
        pa.field("judge_is_agent_model", _B),
        pa.field("judge_correct", _B),
        pa.field("judge_raw", _S),
        # episode totals
        pa.field("e2e_s", _F),
        pa.field("compaction_time_s", _F),
        pa.field("compaction_count", _I),
        pa.field("turn_p50_s", _F),  # chat_agent: latency of the turns that applied no compaction
        pa.field("turn_p95_s", _F),
        pa.field("mean_prompt_tokens", _F),  # chat_agent: the prompt a turn was answered from, on average
        pa.field("answer_time_s", _F),
        pa.field("questions", _I),
        pa.field("compacted_input_tokens", pa.int64()),
        pa.field("summary_tokens_total", pa.int64()),
        pa.field("cell_wall_s", _F),
    ]
)
COLUMNS = frozenset(SCHEMA.names)


def compaction_columns(stats: CompactionStats) -> dict[str, Any]:
    """The result columns of one compaction (summary rows, and turn rows that compacted)."""
    return {
        "compacted": True,
        "history_tokens": stats.history_tokens,
        "input_tokens": stats.input_tokens,
        "chunks": stats.chunks,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "computed_prefill_tokens": stats.computed_prefill_tokens,
        "prefill_floor_tokens": stats.prefill_floor_tokens,
        "output_tokens": stats.output_tokens,
        "summary_tokens": stats.summary_tokens,
        "compacted_tokens": stats.compacted_tokens,
        "compaction_latency_s": stats.latency_s,
        "retries": stats.retries,
        "bad_chunks": len(stats.empty_or_runaway_chunks),
        "user_words_kept": stats.user_words_kept,
        "user_words_tokens": stats.user_words_tokens,
        "pinned_lines": sum(c.pinned_lines for c in stats.per_chunk),
    }


def to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows as a table of exactly SCHEMA; an unknown column or a missing required value is an error."""
    for row in rows:
        unknown = set(row) - COLUMNS
        if unknown:
            raise ValueError(f"columns not in the results schema: {sorted(unknown)}")
    table = pa.Table.from_pylist([dict(r) for r in rows], schema=SCHEMA)
    for field in SCHEMA:
        if not field.nullable and table.column(field.name).null_count:
            raise ValueError(f"column {field.name} must be set on every row")
    return table


class ResultStore:
    """A folder of per-cell Parquet files (`cells/`) plus error notes (`errors/`) of failed cells."""

    def __init__(self, root: str | Path, schema: pa.Schema = SCHEMA) -> None:
        self.root = Path(root)
        self.schema = schema  # every cell file has exactly this schema (the sweep's by default)
        self.cells = self.root / "cells"
        self.errors = self.root / "errors"

    def done(self) -> set[str]:
        if not self.cells.exists():
            return set()
        return {p.name.removesuffix(".parquet") for p in self.cells.glob("*.parquet") if not p.name.startswith(".")}

    def write(self, cell_id: str, table: pa.Table) -> Path:
        """Write one cell's rows atomically; a cell already written is never written twice."""
        if table.schema != self.schema:
            raise ValueError("a cell's table must have exactly the results schema")
        self.cells.mkdir(parents=True, exist_ok=True)
        final = self.cells / f"{cell_id}.parquet"
        if final.exists():
            raise FileExistsError(f"{final} exists: cell {cell_id} is already done")
        temporary = self.cells / f".{cell_id}.{os.getpid()}.tmp"
        pq.write_table(table, temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        (self.errors / f"{cell_id}.txt").unlink(missing_ok=True)
        return final

    def write_error(self, cell_id: str, message: str) -> None:
        self.errors.mkdir(parents=True, exist_ok=True)
        (self.errors / f"{cell_id}.txt").write_text(message)

    def read(self) -> pa.Table:
        if not self.done():
            return self.schema.empty_table()
        return ds.dataset(self.cells, format="parquet", schema=self.schema).to_table()


def integrity(table: pa.Table) -> dict[str, int]:
    """Counts that prove a dataset whole: rows, cells, duplicate keys, agent cells missing turns or totals."""
    cells = table.column("cell_id").to_pylist()
    events = table.column("event").to_pylist()
    turns = table.column("turn_index").to_pylist()
    facts = table.column("fact_index").to_pylist()
    keys = Counter(zip(cells, events, turns, facts, table.column("repeat").to_pylist(), strict=True))
    by_cell: dict[str, list[int]] = {}
    episodes: Counter[str] = Counter()
    for cell, event, turn in zip(cells, events, turns, strict=True):
        if event == "turn":
            by_cell.setdefault(cell, []).append(turn)
        elif event == "episode":
            episodes[cell] += 1
    gaps = sum(sorted(t) != list(range(len(t))) for t in by_cell.values())
    return {
        "rows": table.num_rows,
        "cells": len(set(cells)),
        "duplicate_rows": sum(n - 1 for n in keys.values()),
        "agent_cells_with_turn_gaps": gaps,
        "agent_cells_without_one_episode_row": sum(episodes[c] != 1 for c in by_cell),
    }
