"""The chain benchmark's own arithmetic (`jobs.bench.chain`): pure, no service."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from compaction.options import CompactionOptions
from jobs.bench.chain import METHODS, OURS, SEQUENTIAL_MOST, around, options, read_rows, sizes, summarise
from jobs.data.canaries import invented


def test_every_methods_options_are_valid_and_leave_the_room_the_budget_sets() -> None:
    for method in METHODS:
        opts = CompactionOptions.parse(options(method, budget=3000, history_tokens=10_000, scale=1.0))
        assert opts.user_words_tokens == 300 and opts.carry_summary_tokens == 0
        assert (opts.ledger_tokens or 0) == (450 if method == "tiers" else 0)
        assert opts.clearing == {"tiers": "auto", "clearing": "only"}.get(method, "off")
    assert options("summary", 3000, 10_000, 1.0)["max_chunk_summary_tokens"] == (3000 - 300 - 256) // 10
    assert options("sequential", 30_000, 10_000, 1.0)["max_chunk_summary_tokens"] == SEQUENTIAL_MOST
    smaller = options("tiers", 3000, 10_000, 0.5)
    assert smaller["ledger_tokens"] == 450 and smaller["user_words_tokens"] == 150  # a retry spares the ledger


def test_what_the_service_writes_is_not_counted_as_invented() -> None:
    text = '[tool output cleared to save context: 412 tokens, it began "x"] [archived: arc-0123456789abcdef01234567]'
    assert invented(text, "x") and not invented(OURS.sub("", text), "x")
    brackets = '[tool output cleared to save context: 161 tokens, it began "a = b[:11]", it held "run_x(7)"]'
    cut = 'tool: [tool output cleared to save context: 918 tokens, it began "Money", it held "get_user(49, …'
    border = 'cleared to save context: 536 tokens, it began "Money", it held "logger.debug(\'in\', rounding)"]'
    for stub in (brackets, cut, border):
        assert invented(stub, "a = b[:11] run_x(7) Money get_user(49)") and not invented(OURS.sub("", stub), "tool")


def row(method: str, r: int, canary: str, survived: bool, share: float) -> dict:
    return {"method": method, "kind": "coding", "seed": 0, "round": r, "canary": canary, "survived": survived,
            "recalled": True, "share": share, "seconds": 1.0, "invented": 0}  # fmt: skip


def test_the_table_counts_per_type_at_the_first_and_last_round_and_a_later_file_replaces_a_method(
    tmp_path: Path,
) -> None:
    rows = [
        row("tiers", 1, "fact", True, 0.3),
        row("tiers", 5, "fact", False, 0.29),
        row("summary", 5, "fact", True, 0.2),
    ]
    (tiers, summary) = summarise(rows, 5)
    assert tiers["fact@1"] == "1/1" and tiers["fact@5"] == "0/1" and tiers["max_share"] == "30%"
    assert summary["fact@1"] == "-" and summary["kept@last"] == 1
    assert sizes(rows, 5)[0]["round 5"] == "29%"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist([row("summary", 5, "fact", False, 0.25)]), tmp_path / "b.parquet")
    merged = read_rows([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert [r["survived"] for r in merged if r["method"] == "summary"] == [False] and len(merged) == 3


def test_an_invented_token_is_shown_where_it_occurs() -> None:
    text = "Summary:\nThe run ended with `19 passed` today.\nNothing else."
    assert around(text, ["19 passed"], 10) == "ded with `19 passed` today. ⏎ N" and around(text, ["absent"]) == ""
