"""The retention benchmark: known facts, recall, grounding columns, rows and report (fake backend)."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.history import parse_messages, template_view
from compaction.tokenizer import ChatTokenizer
from jobs.data.conversations import SHARED_DATA
from jobs.data.datasets import load_locomo
from jobs.data.facts import Fact, coding_history, locomo_history
from jobs.experiments.cells import ModelAccess, run_cell
from jobs.experiments.grid import DataPaths, SweepConfig, expand
from jobs.experiments.results import ResultStore, integrity
from jobs.experiments.retention import recalled
from jobs.report import retention, retention_by_kind, write_report
from serving.models import load_catalogue
from tests.fakes import ChatMLTokenizer, FakeBackend
from tests.test_sweep import MODEL, needs_shared


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def test_recall_is_whole_string_case_and_space_insensitive() -> None:
    fact = Fact("command", "python -m pytest  tests/test_x.py", "?", 0)
    assert recalled(fact, "ran python -m pytest tests/test_x.py twice")
    assert recalled(Fact("locomo_qa", "Sweden", "?", 0), "she moved from sweden.")
    assert not recalled(Fact("locomo_qa", "Sweden", "?", 0), "she moved from swedenborg")
    assert not recalled(fact, "ran python -m pytest tests/test_x.pyc")


def test_coding_facts_are_the_planted_ones(tokenizer: ChatTokenizer) -> None:
    known = coding_history(3, 2048, tokenizer)
    assert known.label == "coding seed 3"
    assert sorted(f.kind for f in known.facts) == ["command", "constraint", "failing_test", "fix", "root_cause"]
    assert [f.message_index for f in known.facts] == sorted(f.message_index for f in known.facts)
    for fact in known.facts:
        (message,) = parse_messages([known.messages[fact.message_index]])
        assert fact.text in template_view(message)["content"] and fact.question.endswith("?")


@needs_shared
def test_locomo_facts_are_answers_spelled_out_in_their_evidence(tokenizer: ChatTokenizer) -> None:
    sample = load_locomo(SHARED_DATA / "locomo10.json")[0]
    known = locomo_history(sample, 3000, tokenizer)
    assert known.label == "locomo conv-26" and len(known.facts) >= 5
    assert all(f.message_index < len(known.messages) for f in known.facts)
    for fact in known.facts:
        assert fact.text.lower() in known.messages[fact.message_index]["content"].lower()
    assert {"Sweden", "Adoption agencies"} <= {f.text for f in known.facts}
    longer = locomo_history(sample, 6000, tokenizer)
    assert len(longer.facts) > len(known.facts)  # more sessions read, more evidence inside


def scripted(request: GenerationRequest) -> tuple[str, str]:
    """First summaries invent, retries are grounded; the agent never knows; the judge says WRONG."""
    kind, *rest = request.request_id.split("-")
    if kind == "chunk":
        return ("The GolfBridge project is funded by the NSF." if rest[-1] == "first" else "Tests ran."), "stop"
    return {"answer": "no idea", "judge": "WRONG"}[kind], "stop"


def cells() -> list[Any]:
    block = {
        "name": "ret",
        "kind": "retention",
        "datasets": ["coding", "locomo"],
        "strategies": ["parallel", "sequential", "extractive"],
        "chunk_tokens": [512],
        "input_tokens": [2048],
        "summary_tokens": 256,
    }
    config = {"name": "t", "models": [MODEL], "judges": [MODEL], "experiments": [block]}
    return expand(SweepConfig.model_validate(config), load_catalogue()).cells


@needs_shared
def test_retention_cells_measure_recall_and_invention_and_report_them(tmp_path: Path, model_path: Path) -> None:
    access = ModelAccess(
        MODEL, str(model_path), 8192, 16, functools.partial(FakeBackend, block_size=16, script=scripted), "fake"
    )
    store = ResultStore(tmp_path)
    paths = DataPaths().resolve(SHARED_DATA)
    for cell in cells():
        store.write(cell.cell_id, asyncio.run(run_cell(cell, paths, access, access, cold_start=True)))
    table = store.read()
    assert integrity(table)["duplicate_rows"] == 0
    rows = table.to_pandas()
    runs = rows[rows.event == "retention"].set_index(["dataset", "strategy"])
    facts = rows[rows.event == "fact"]
    assert len(runs) == 6 and (facts.groupby("cell_id").size() == runs.set_index("cell_id").facts).all()
    for dataset in ("coding", "locomo"):
        for strategy in ("parallel", "sequential"):
            run = runs.loc[(dataset, strategy)]
            assert run.summaries_ungrounded_first == run.model_summaries == run.chunks > 0  # every first attempt
            assert run.summaries_ungrounded_out == run.fallback_chunks == 0  # the retries were grounded

        assert runs.loc[(dataset, "extractive")].model_summaries == 0
    assert runs.loc[("coding", "extractive")].recall_exact > 0  # verbatim lines keep planted strings
    # "Tests ran." holds no fact: what parallel and sequential keep comes from the pinned lines and the user's words
    model = runs.loc["coding"].loc[["parallel", "sequential"]]
    assert (model.pinned_lines > 0).all() and (runs.loc["coding"].user_words_kept > 0).all()
    constraint = facts[(facts.dataset == "coding") & (facts.fact_kind == "constraint")]
    assert constraint.recalled_exact.all()  # the user's constraint, verbatim in every run
    assert set(facts.judge_correct) == {False} and set(facts.judge_is_agent_model) == {True}
    assert set(facts[facts.dataset == "coding"].fact_kind) == {
        "constraint", "failing_test", "command", "root_cause", "fix"
    }  # fmt: skip
    summary = retention(rows)
    parallel = summary[(summary.strategy == "parallel") & (summary.dataset == "coding")].iloc[0]
    assert parallel.invented_summaries_before == 1.0 and parallel.invented_summaries_after == 0.0
    assert parallel.recall_judged == 0.0 and parallel.grounding_threshold == 0.7
    assert "fix" in retention_by_kind(rows).columns
    report = write_report(tmp_path, tmp_path / "out").read_text()
    assert "## Retention: recall of known facts" in report and "![retention](retention.png)" in report
    assert (tmp_path / "out" / "retention.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("strategy", ["parallel", "extractive"])
def test_report_show_prints_the_retention_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str, model_path: Path
) -> None:
    from jobs.report import main

    if not (SHARED_DATA / "locomo10.json").exists():
        pytest.skip("shared data absent")
    access = ModelAccess(
        MODEL, str(model_path), 8192, 16, functools.partial(FakeBackend, block_size=16, script=scripted), "fake"
    )
    cell = next(c for c in cells() if c.dataset == "coding" and c.strategy == strategy)
    store = ResultStore(tmp_path)
    store.write(cell.cell_id, asyncio.run(run_cell(cell, DataPaths().resolve(SHARED_DATA), access, None, True)))
    assert main([str(tmp_path), "--show", "retention"]) == 0
    out = capsys.readouterr().out
    assert "Retention: recall of known facts" in out and f"| coding | {strategy} |" in out


@needs_shared
def test_the_in_process_runner_writes_cells_and_records_failures(tmp_path: Path, model_path: Path) -> None:
    from jobs.sweep import _run_in_order

    good = ModelAccess(
        MODEL, str(model_path), 8192, 16, functools.partial(FakeBackend, block_size=16, script=scripted), "fake"
    )
    broken = ModelAccess(MODEL, str(model_path), 8192, 16, functools.partial(FakeBackend, fail_on={0}), "fake")
    todo = [c for c in cells() if c.dataset == "coding" and c.strategy != "sequential"]
    store = ResultStore(tmp_path)
    paths = DataPaths().resolve(SHARED_DATA)
    progress = asyncio.run(_run_in_order(todo[:1], store, paths, {MODEL: broken}))
    assert (progress.done, progress.failed) == (0, 1) and "BackendError" in next(store.errors.iterdir()).read_text()
    progress = asyncio.run(_run_in_order(todo, store, paths, {MODEL: good}))
    assert (progress.done, progress.failed) == (2, 0) and store.done() == {c.cell_id for c in todo}
    assert not list(store.errors.iterdir())  # a cell written later clears its error note
