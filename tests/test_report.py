"""The report on a small results set made by real cells on a fake backend: tables and PNGs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from jobs.experiments.results import ResultStore
from jobs.report import chunk_table, episodes, markdown, stability, tau_table, write_report
from tests.test_sweep import needs_shared, run_in_process, tiny_cells


@needs_shared
def test_report_writes_every_section_and_figure(tmp_path: Path, model_path: Path) -> None:
    cells = tiny_cells()
    cells += [c.model_copy(update={"repeat": 1, "temperature": 0.5}) for c in cells[:1]]
    cells += [c.model_copy(update={"repeat": 2, "temperature": 0.5}) for c in cells[:1]]
    store = ResultStore(tmp_path / "results")
    run_in_process(cells, store, model_path)
    report = write_report(store.root, tmp_path / "out")
    text = report.read_text()
    for title in ("(a) Summary output tokens", "(b) Run-to-run", "(c) Compaction share", "(d) Parallel vs"):
        assert f"## {title}" in text
    for figure in ("output_length", "tau"):
        png = tmp_path / "out" / f"{figure}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"![{figure}]({figure}.png)" in text
    rows = store.read().to_pandas()
    runs = episodes(rows)
    assert list(tau_table(runs).tau) == [300, 400]  # the MC runs at two taus
    assert chunk_table(runs).empty  # no setting here was run with two compaction shapes
    repeated = stability(rows)
    # the fake writes the same summary every time: no spread, identical text
    assert len(repeated) >= 1 and repeated.cv_summary_tokens.max() == 0 and repeated.pairwise_rouge_l.min() == 1.0


def test_markdown_table_formats_numbers_and_blanks() -> None:
    frame = pd.DataFrame({"a": [1, 2], "b": [0.5, None], "c": ["x", "y"]})
    assert markdown(frame).splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.50 | x |", "| 2 |  | y |"]
    assert markdown(pd.DataFrame()) == "_no rows_"


def test_report_refuses_an_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no results"):
        write_report(tmp_path, tmp_path / "out")
