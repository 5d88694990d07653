"""The results store (atomic per-cell files, fixed schema), cells on a fake backend, and a
resumable sweep through real Ray tasks: stop mid-way, run again, nothing lost or duplicated."""

from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from compaction.backend import GenerationRequest
from jobs.data.conversations import SHARED_DATA
from jobs.experiments.cells import ModelAccess, run_cell
from jobs.experiments.grid import Cell, DataPaths, SweepConfig, expand
from jobs.experiments.results import SCHEMA, ResultStore, integrity, to_table
from serving.models import load_catalogue
from serving.weights import model_dir
from tests.fakes import FakeBackend

needs_shared = pytest.mark.skipif(
    not (SHARED_DATA / "locomo10.json").exists(), reason=f"shared benchmark data not found in {SHARED_DATA}"
)
MODEL = "smollm2-135m-instruct"
TINY = {
    "name": "tiny",
    "models": [MODEL],
    "judges": [MODEL],
    "experiments": [
        {
            "name": "lengths",
            "kind": "summary",
            "datasets": ["locomo"],
            "strategies": ["sequential", "parallel"],
            "chunk_tokens": [256],
            "input_tokens": [400, 700],
            "variants": ["concise", "default"],
            "summary_tokens": 32,
            "concurrency": 2,
        },
        {"name": "mc", "kind": "agent", "datasets": ["locomo_mc"], "chunk_tokens": [128], "taus": [300, 400]},
        {"name": "qa", "kind": "agent", "datasets": ["hotpotqa"], "limit": 1, "taus": [400], "chunk_tokens": [256]},
    ],
}


def scripted(request: GenerationRequest) -> tuple[str, str]:
    """Summaries for chunk prompts, a verdict for the judge, a letter for answers."""
    kind = request.request_id.split("-")[0]
    return {"chunk": "A short summary.", "judge": "CORRECT", "answer": "(B) the answer"}[kind], "stop"


def fake_access(model: Path) -> ModelAccess:
    """The CPU default's real tokenizer (`model`: its folder) over a fake backend."""
    factory = functools.partial(FakeBackend, block_size=16, script=scripted)
    return ModelAccess(MODEL, str(model), 8192, 16, factory, "fake")


def tiny_cells() -> list[Cell]:
    return expand(SweepConfig.model_validate(TINY), load_catalogue()).cells


def run_in_process(cells: list[Cell], store: ResultStore, model: Path) -> None:
    paths = DataPaths().resolve(SHARED_DATA)
    for cell in cells:
        access = fake_access(model)
        store.write(cell.cell_id, asyncio.run(run_cell(cell, paths, access, access, cold_start=True)))


def test_store_writes_whole_cells_once_and_ignores_temporaries(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    assert store.done() == set() and store.read().schema == SCHEMA
    row = {
        "cell_id": "c1",
        "experiment": "e",
        "kind": "summary",
        "event": "summary",
        "model": "m",
        "dataset": "locomo",
        "strategy": "sequential",
        "layout": "sequential",
        "variant": "default",
        "summary_budget": 8,
        "fixed_output_tokens": False,
        "temperature": 0.0,
        "repeat": 0,
        "backend": "fake",
        "cold_start": False,
        "output_tokens": 5,
    }
    store.write("c1", to_table([row]))
    (store.cells / ".c2.123.tmp").write_bytes(b"half a parquet file")  # what a crash mid-write leaves
    assert store.done() == {"c1"} and store.read().num_rows == 1
    with pytest.raises(FileExistsError):
        store.write("c1", to_table([row]))
    with pytest.raises(ValueError, match="not in the results schema"):
        to_table([{**row, "surprise": 1}])
    with pytest.raises(ValueError, match="column model must be set"):
        to_table([{**row, "model": None}])
    with pytest.raises(ValueError, match="exactly the results schema"):
        store.write("c3", pa.table({"x": [1]}))
    store.write_error("c4", "boom")
    assert (store.errors / "c4.txt").read_text() == "boom"


@needs_shared
def test_cells_on_a_fake_backend_fill_the_schema(tmp_path: Path, model_path: Path) -> None:
    store = ResultStore(tmp_path)
    cells = tiny_cells()
    run_in_process(cells, store, model_path)
    rows = store.read().to_pylist()
    assert integrity(store.read())["duplicate_rows"] == 0 and store.done() == {c.cell_id for c in cells}
    summaries = [r for r in rows if r["event"] == "summary"]
    assert len(summaries) == 8 and all(r["summary_text"] and r["output_tokens"] for r in summaries)
    mc = [r for r in rows if r["experiment"] == "mc" and r["step"] == "question"]
    assert len(mc) == 6 and [r["mc_correct"] for r in mc[:3]] == [True, False, False]  # "(B)" is right for q1 only
    qa = [r for r in rows if r["experiment"] == "qa" and r["step"] == "question"]
    assert qa and all(r["judge_correct"] is True and r["judge_is_agent_model"] is True for r in qa)
    assert all(r["f1"] is not None and r["em"] == 0.0 for r in qa)
    episodes = [r for r in rows if r["event"] == "episode"]
    assert len(episodes) == 3 and all(r["compaction_count"] >= 1 and r["e2e_s"] > 0 for r in episodes)


@pytest.mark.ray
@needs_shared
def test_sweep_stopped_midway_resumes_without_loss_or_duplicates(tmp_path: Path, model_path: Path) -> None:
    import ray

    from jobs.sweep import cell_task, connect, run_cells

    cells = tiny_cells()
    paths = DataPaths().resolve(SHARED_DATA)
    concurrency = {e["name"]: e.get("concurrency", 1) for e in TINY["experiments"]}  # type: ignore[union-attr]
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    started = False if ray.is_initialized() else connect(None, 2)
    try:
        task = ray.remote(num_cpus=0.25)(cell_task)

        def launch(cell: Cell) -> Any:
            return task.remote(
                cell, paths, fake_access(model_path), fake_access(model_path), concurrency[cell.experiment] == 1
            )

        store = ResultStore(tmp_path / "run")
        first = run_cells(cells, store, launch, concurrency, stop_after=3)
        assert first.done == 3 and len(store.done()) == 3  # cells in flight at the stop were not written
        (store.cells / ".half-written.999.tmp").write_bytes(b"garbage")
        todo = [c for c in cells if c.cell_id not in store.done()]
        second = run_cells(todo, store, launch, concurrency)
        assert second.done == len(cells) - 3 and second.failed == 0
    finally:
        if started:
            ray.shutdown()
    counts = integrity(store.read())
    reference = ResultStore(tmp_path / "reference")
    run_in_process(cells, reference, model_path)
    assert counts == integrity(reference.read())
    assert counts["cells"] == len(cells) and counts["duplicate_rows"] == 0
    assert counts["agent_cells_with_turn_gaps"] == 0 and counts["agent_cells_without_one_episode_row"] == 0


def test_cli_dry_run_check_and_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from jobs.sweep import main

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    results = tmp_path / "results"
    assert main(["--config", str(config), "--results", str(results), "--dry-run"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == [c.cell_id for c in tiny_cells()]
    assert main(["--config", str(config), "--results", str(results), "--check"]) == 0
    assert "'rows': 0" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**TINY, "models": ["no-such-model"]}))
    assert main(["--config", str(bad)]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    missing = ["--config", str(config), "--results", str(results), "--data-dir", str(tmp_path / "nowhere")]
    assert main(missing) == 2  # refused before any Ray or engine starts
    assert "not found; pass --data-dir" in capsys.readouterr().err


def test_service_backend_reaches_every_model_over_http() -> None:
    from jobs.sweep import start_models
    from serving.backends import OpenAIBackend

    config = SweepConfig.model_validate({**TINY, "backend": {"kind": "service", "base_url": "http://127.0.0.1:18150"}})
    accesses, actors = start_models(config, load_catalogue(), tiny_cells())
    assert actors == [] and list(accesses) == [MODEL]
    access = accesses[MODEL]
    backend = access.backend_factory()
    assert isinstance(backend, OpenAIBackend) and backend.model == MODEL
    assert str(backend.client.base_url) == "http://127.0.0.1:18150" and access.context_window == 8192
    assert access.label == "service http://127.0.0.1:18150" and access.tokenizer_path == str(model_dir())


def test_a_local_ray_that_misses_its_start_up_wait_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray gives its own node a fixed 30 s to register; on a busy machine the sweep says how to go on."""
    import ray

    from jobs.sweep import connect

    def busy(*_: Any, **__: Any) -> None:
        raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", busy)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit, match=r"run the sweep again .* --address"):
        connect(None, 2)
