"""The planning benchmark (`jobs.bench.planning`) runs its rows in fresh processes, as its command does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.bench.planning import ROOT, run_one


def test_a_row_plans_cold_and_warm_and_compacts_with_every_chunk_cached(model_path: Path, locomo: Any) -> None:
    row = run_one(ROOT, 1600, "512")
    assert row["chunk_tokens"] == 512 and row["chunks"] >= 3  # about 1,600 tokens of history, cut at 512
    assert row["cold_s"] > 0 and row["warm_s"] > 0 and row["reused_s"] > 0
    assert row["cold_peak_mib"] > 0 and row["warm_peak_mib"] > 0
