"""Sweep configs: validation with clear errors, expansion, stable ids, the scheduler."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from compaction.errors import InvalidInput, UnknownModel
from jobs.experiments.grid import CONFIGS, SweepConfig, expand, load_config
from jobs.sweep import Scheduler
from serving.models import load_catalogue

CATALOGUE = load_catalogue()


def test_paper_grid_parses_and_expands_to_the_papers_cell_count() -> None:
    config = load_config(CONFIGS / "paper.yaml")
    expansion = expand(config, CATALOGUE)
    per_block = Counter(c.experiment for c in expansion.cells)
    # qa_grid: 4 models x 2 datasets x (sequential + 4 parallel chunk sizes) x 6 taus x 3 variants = 720, none dropped:
    # every model serves 131,072 tokens (gpt-oss-120b on one H100 too), and tau 96k + summary + headroom needs 110,592.
    assert per_block["qa_grid"] == 4 * 2 * 5 * 6 * 3 == 720
    assert expansion.dropped == []
    # (a) 4 models x 7 sizes x 3 variants; (b) 4 x 3 variants x 5 repeats
    assert per_block["output_length"] == 84 and per_block["stability"] == 60
    assert {c.tau for c in expansion.cells if c.model == "gpt-oss-120b" and c.kind == "agent"} == {
        16384,
        32768,
        49152,
        65536,
        81920,
        98304,
    }
    grid = [c for c in expansion.cells if c.experiment == "qa_grid"]
    assert {c.model for c in grid} == set(config.models) and len({c.cell_id for c in expansion.cells}) == 864
    assert {(c.strategy, c.chunk_tokens) for c in grid} == {("sequential", None)} | {
        ("parallel", b) for b in (16384, 8192, 4096, 2048)
    }
    assert {c.judge_model for c in grid if c.model == "llama-3.3-70b-instruct"} == {"gpt-oss-120b"}
    assert {c.judge_model for c in grid if c.model != "llama-3.3-70b-instruct"} == {"llama-3.3-70b-instruct"}


def test_cpu_smoke_covers_every_family() -> None:
    expansion = expand(load_config(CONFIGS / "cpu-smoke.yaml"), CATALOGUE)
    assert not expansion.dropped
    cells = expansion.cells
    assert {c.variant for c in cells if c.experiment == "output_length"} == {"concise", "default", "detailed"}
    stability = [c for c in cells if c.experiment == "stability"]
    assert len(stability) >= 2 and all(c.temperature > 0 for c in stability)
    assert len({c.tau for c in cells if c.experiment == "tau"}) >= 3
    shapes = {(c.strategy, c.chunk_tokens) for c in cells if c.experiment == "chunking"}
    assert ("sequential", None) in shapes and len(shapes) >= 3
    assert all(c.fixed_output_tokens for c in cells if c.experiment == "chunking")
    assert {c.dataset for c in cells} == {"locomo", "hotpotqa", "locomo_mc", "coding"}
    retention = [c for c in cells if c.experiment == "retention"]
    assert {(c.dataset, c.strategy) for c in retention} == {
        (d, s) for d in ("coding", "locomo") for s in ("parallel", "sequential", "extractive")
    }
    assert all(c.judge_model == c.model for c in cells if c.kind == "agent")  # one CPU model: flagged in rows


def test_cell_ids_are_stable_and_change_with_any_parameter() -> None:
    first = expand(load_config(CONFIGS / "cpu-smoke.yaml"), CATALOGUE).cells
    again = expand(load_config(CONFIGS / "cpu-smoke.yaml"), CATALOGUE).cells
    assert [c.cell_id for c in first] == [c.cell_id for c in again]
    assert first[0].model_copy(update={"summary_tokens": 999}).cell_id != first[0].cell_id
    assert first[0].cell_id.startswith("output_length-locomo-seq-in512-concise-r0-")


BASE = {
    "name": "t",
    "models": ["smollm2-135m-instruct"],
    "experiments": [{"name": "a", "kind": "agent", "datasets": ["hotpotqa"], "taus": [512]}],
}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({"experiments": [{"name": "a", "kind": "agent", "datasets": ["hotpotqa"]}]}, "needs taus"),
        ({"experiments": [{"name": "a", "kind": "summary", "datasets": ["locomo"]}]}, "needs input_tokens"),
        (
            {"experiments": [{"name": "a", "kind": "summary", "datasets": ["hotpotqa"], "input_tokens": [9]}]},
            "datasets: [locomo]",
        ),
        ({"experiments": [{**BASE["experiments"][0], "variants": ["short"]}]}, "experiments.0.variants.0"),
        ({"experiments": [BASE["experiments"][0]] * 2}, "experiment names repeat"),
        ({"backend": {"kind": "service"}}, "needs backend.base_url"),
        ({"experiments": [{"name": "r", "kind": "retention", "datasets": ["coding"]}]}, "needs input_tokens"),
        (
            {"experiments": [{"name": "r", "kind": "retention", "datasets": ["hotpotqa"], "input_tokens": [9]}]},
            "coding and analysis traces and LoCoMo",
        ),
        (
            {"experiments": [{**BASE["experiments"][0], "datasets": ["coding"]}]},
            "coding and analysis traces are for retention",
        ),
        (
            {"experiments": [{**BASE["experiments"][0], "grounding_thresholds": [1.5]}]},
            "grounding_thresholds must lie in [0, 1]",
        ),
    ],
)
def test_bad_configs_name_the_field(tmp_path: Path, change: dict, problem: str) -> None:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, **change}))
    with pytest.raises(InvalidInput) as err:
        load_config(path)
    assert problem in str(err.value) and str(path) in str(err.value)


def test_unknown_model_and_window_drop() -> None:
    with pytest.raises(UnknownModel, match="hosted"):
        expand(SweepConfig.model_validate({**BASE, "models": ["gpt-5"]}), CATALOGUE)
    big = {**BASE, "experiments": [{**BASE["experiments"][0], "taus": [512, 8000]}]}
    expansion = expand(SweepConfig.model_validate(big), CATALOGUE)
    assert [c.tau for c in expansion.cells] == [512]
    assert "over smollm2-135m-instruct's 8192" in expansion.dropped[0][1]


def test_scheduler_runs_blocks_in_order_with_their_concurrency() -> None:
    config = load_config(CONFIGS / "cpu-smoke.yaml")
    cells = expand(config, CATALOGUE).cells
    scheduler = Scheduler(cells, {e.name: e.concurrency for e in config.experiments})
    first = scheduler.ready()
    assert [c.experiment for c in first] == ["output_length"] * 3 and scheduler.ready() == []
    for cell in first:
        scheduler.finish(cell)
    seen = [c.experiment for c in first]
    while scheduler.pending:
        batch = scheduler.ready()
        assert batch and len({c.experiment for c in batch}) == 1
        assert len(batch) <= {e.name: e.concurrency for e in config.experiments}[batch[0].experiment]
        seen += [c.experiment for c in batch]
        for cell in batch:
            scheduler.finish(cell)
    assert seen == [c.experiment for c in cells]  # config order, every cell once


def test_retention_axes_and_which_cells_need_the_window() -> None:
    block = {
        "name": "ret",
        "kind": "retention",
        "datasets": ["coding"],
        "strategies": ["sequential", "parallel", "extractive"],
        "layouts": ["prefix_exact", "independent"],
        "chunk_tokens": [1024],
        "input_tokens": [4000, 20000],
        "grounding_thresholds": [0.5, 0.9],
    }
    expansion = expand(SweepConfig.model_validate({**BASE, "experiments": [block]}), CATALOGUE)
    kept = {(c.strategy, c.layout, c.input_tokens, c.grounding_threshold) for c in expansion.cells}
    # 20k tokens exceed the 8k window only where the prompt carries the history before the chunk
    assert {(s, layout, size) for s, layout, size, _ in kept} == {
        ("sequential", "sequential", 4000),
        ("parallel", "prefix_exact", 4000),
        ("parallel", "independent", 4000),
        ("parallel", "independent", 20000),
        ("extractive", "extractive", 4000),
        ("extractive", "extractive", 20000),
    }
    assert {t for *_, t in kept} == {0.5, 0.9}
    assert {(c.strategy, c.layout) for c, _ in expansion.dropped} == {
        ("sequential", "sequential"),
        ("parallel", "prefix_exact"),
    }
    cell = next(c for c in expansion.cells if c.strategy == "extractive")
    assert cell.cell_id.startswith(f"ret-coding-ext1024-in4000-default-g{cell.grounding_threshold:g}-r0-")
    assert cell.compaction_options().strategy == "extractive"
    assert cell.compaction_options().grounding_threshold == cell.grounding_threshold
    assert cell.model_copy(update={"grounding_threshold": 0.1}).cell_id != cell.cell_id
    unset = cell.model_copy(update={"grounding_threshold": None})
    assert unset.compaction_options().grounding_threshold == 0.7  # the option's default


def test_cells_without_a_threshold_keep_the_ids_they_had_before_it_existed() -> None:
    cells = expand(load_config(CONFIGS / "cpu-smoke.yaml"), CATALOGUE).cells
    ids = {c.cell_id for c in cells}  # finished results of earlier sweeps are still recognised
    assert "output_length-locomo-seq-in512-concise-r0-bcefee9d53" in ids
    assert "mc-locomo_mc-par128-tau256-default-r0-bec15a0c3c" in ids
