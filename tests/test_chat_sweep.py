"""The chat_agent sweep family: its grid (pure) and one cell through the real service into the results and report."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import yaml

from compaction.errors import InvalidInput
from jobs.data.conversations import SHARED_DATA
from jobs.experiments.cells import ModelAccess, run_cell
from jobs.experiments.grid import CONFIGS, SweepConfig, expand, load_config
from jobs.experiments.results import ResultStore, integrity
from jobs.report import chat_agent_table, episodes, load_rows
from serving.backends import OpenAIBackend
from serving.models import load_catalogue
from tests.support import SERVED_MODEL

CATALOGUE = load_catalogue()


def test_the_chat_config_crosses_modes_with_chunk_sizes() -> None:
    cells = expand(load_config(CONFIGS / "cpu-chat.yaml"), CATALOGUE).cells
    assert [(c.mode, c.strategy, c.chunk_tokens) for c in cells] == [
        ("blocking_sequential", "sequential", None),
        ("blocking_parallel", "parallel", 512),
        ("background_parallel", "parallel", 512),
    ]
    assert [c.background_threshold for c in cells] == [None, None, 2560]
    assert all(c.kind == "chat_agent" and c.tau == 4096 and c.mode in c.cell_id for c in cells)


def config(**experiment: Any) -> dict[str, Any]:
    block = {"name": "chat", "kind": "chat_agent", "datasets": ["locomo"], "taus": [1024], "modes": ["none"]}
    return {
        "name": "t",
        "models": [SERVED_MODEL],
        "backend": {"kind": "service", "base_url": "http://127.0.0.1:1"},
        "experiments": [{**block, **experiment}],
    }


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"backend": {"kind": "engine"}}, "backend: kind: service"),
        ({"experiments": [{**config()["experiments"][0], "modes": None}]}, "need them"),
        ({"experiments": [{**config()["experiments"][0], "taus": None}]}, "needs taus"),
        ({"experiments": [{**config()["experiments"][0], "modes": ["eager"]}]}, "modes"),
    ],
)
def test_a_chat_agent_block_needs_the_service_modes_and_taus(
    change: dict[str, Any], needle: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**config(), **change}))
    with pytest.raises(InvalidInput, match=needle):
        load_config(path)


@pytest.mark.ray
@pytest.mark.engine
async def test_a_chat_agent_cell_through_the_service(
    service: Any, model_path: Path, tmp_path: Path, locomo: list[dict[str, Any]]
) -> None:
    cfg = SweepConfig.model_validate(
        config(limit=2, questions_per_document=1, modes=["background_parallel"], chunk_tokens=[256],
               summary_tokens=64, answer_tokens=12, background_share=0.6, judge=False)
    )  # fmt: skip
    (cell,) = expand(cfg, CATALOGUE).cells
    factory = functools.partial(OpenAIBackend, service.url, SERVED_MODEL)
    access = ModelAccess(SERVED_MODEL, str(model_path), 8192, 128, factory, "service", service.url)
    table = await run_cell(cell, {"locomo": str(SHARED_DATA / "locomo10.json")}, access, None, False)
    store = ResultStore(tmp_path)
    store.write(cell.cell_id, table)
    assert integrity(store.read())["agent_cells_with_turn_gaps"] == 0
    rows, _ = load_rows(tmp_path)
    turns = rows[rows.event == "turn"]
    assert set(turns.compaction_status) <= {"applied", "running", "none"} and (turns.compaction_status != "none").any()
    summary = chat_agent_table(rows, episodes(rows))
    assert list(summary["mode"]) == ["background_parallel"] and summary.loc[0, "tau"] == 1024
    print(summary.to_string())
