"""The benchmark report: markdown tables and paper-style PNG figures from a sweep's results.

    python jobs/report.py RESULTS_DIR [--out DIR] [--show SECTION]

Sections follow the experiment families: (a) summary output tokens vs input length per
instruction variant; (b) run-to-run stability (coefficient of variation of summary length,
mean pairwise ROUGE-L); (c) compaction share of end-to-end time and compaction count vs τ;
(d) parallel vs sequential over chunk sizes (time, compaction throughput, summary volume);
then answer quality (EM/F1, LoCoMo F1, MC accuracy, judge accuracy), and retention (recall of
known facts, invented salient tokens before and after the grounding check, fallbacks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path (`python jobs/report.py`): make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import pyarrow as pa

from jobs.agent.metrics import coefficient_of_variation, pairwise_rouge_l
from jobs.experiments.results import ResultStore, integrity
from jobs.report_figures import (
    AGENT_KEYS,
    SHAPE,
    plot_chat_agent,
    plot_chunks,
    plot_output_length,
    plot_retention,
    plot_tau,
)


def markdown(frame: pd.DataFrame, digits: int = 2) -> str:
    """A GitHub markdown table (no extra dependency)."""
    if frame.empty:
        return "_no rows_"
    cells = frame.astype(object).where(frame.notna(), "")
    text = [[f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row] for row in cells.to_numpy()]
    head = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in text)])


def output_length(rows: pd.DataFrame) -> pd.DataFrame:
    """(a) Mean output tokens of greedy summaries per model, variant and input size."""
    greedy = rows[(rows.event == "summary") & (rows.temperature == 0)]
    keys = ["model", "strategy", "variant", "target_input_tokens"]
    table = greedy.groupby(keys, dropna=False).agg(
        runs=("cell_id", "size"),
        input_tokens=("input_tokens", "mean"),
        output_tokens=("output_tokens", "mean"),
        summary_tokens=("summary_tokens", "mean"),
        bad_chunks=("bad_chunks", "sum"),
    )
    return table.reset_index()


def stability(rows: pd.DataFrame) -> pd.DataFrame:
    """(b) Repeated summaries of one input: CV of summary length and mean pairwise ROUGE-L."""
    summaries = rows[rows.event == "summary"]
    keys = ["model", "strategy", "variant", "target_input_tokens", "temperature"]
    out = []
    for key, group in summaries.groupby(keys, dropna=False):
        if len(group) < 2:
            continue
        lengths = group.summary_tokens.astype(float).tolist()
        out.append(
            {
                **dict(zip(keys, key, strict=True)),
                "repeats": len(group),
                "mean_summary_tokens": sum(lengths) / len(lengths),
                "cv_summary_tokens": coefficient_of_variation(lengths),
                "pairwise_rouge_l": pairwise_rouge_l(group.summary_text.fillna("").tolist()),
            }
        )
    return pd.DataFrame(out)


def episodes(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per agent run with its time split and compaction volume."""
    runs = rows[rows.event == "episode"].copy()
    runs["compaction_share"] = runs.compaction_time_s / runs.e2e_s
    runs["throughput_tok_s"] = runs.compacted_input_tokens / runs.compaction_time_s.where(runs.compaction_time_s > 0)
    compactions = rows[(rows.event == "turn") & (rows.compacted.fillna(False).astype(bool))]
    per_compaction = compactions.groupby("cell_id").agg(
        mean_compaction_s=("compaction_stall_s", "mean"), output_tokens_total=("output_tokens", "sum")
    )
    return runs.join(per_compaction, on="cell_id")


def tau_table(runs: pd.DataFrame) -> pd.DataFrame:
    """(c) Configurations run at two or more τ: compaction count and share of end-to-end time."""
    runs = runs[runs.kind == "agent"]
    cols = [*AGENT_KEYS, "tau", "compaction_count", "compaction_time_s", "e2e_s", "compaction_share"]
    varied = runs.groupby(AGENT_KEYS, dropna=False).tau.transform("nunique") > 1
    return runs[varied][cols].sort_values([*AGENT_KEYS, "tau"]).reset_index(drop=True)


def chunk_table(runs: pd.DataFrame) -> pd.DataFrame:
    """(d) Settings run with two or more compaction shapes: time, throughput, summary volume."""
    cols = [
        *SHAPE,
        "strategy",
        "chunk_tokens",
        "compaction_count",
        "e2e_s",
        "compaction_time_s",
        "mean_compaction_s",
        "throughput_tok_s",
        "output_tokens_total",
        "summary_tokens_total",
    ]
    runs = runs[runs.kind == "agent"]
    shapes = runs.strategy + ":" + runs.chunk_tokens.astype(str)
    varied = shapes.groupby([runs[k] for k in SHAPE], dropna=False).transform("nunique") > 1
    return runs[varied][cols].sort_values([*SHAPE, "strategy", "chunk_tokens"]).reset_index(drop=True)


CHAT_KEYS = ["model", "dataset", "tau", "chunk_tokens", "mode"]


def chat_agent_table(rows: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The agent through the chat endpoint: its stall per compaction mode, on the same stream and τ."""
    chat = runs[runs.kind == "chat_agent"].copy()
    if chat.empty:
        return pd.DataFrame()
    questions = rows[(rows.kind == "chat_agent") & (rows.event == "turn") & (rows.step == "question")]
    chat = chat.join(questions.groupby("cell_id").f1.mean().rename("answer_f1"), on="cell_id")
    chat["stall_share"] = chat.compaction_time_s / chat.e2e_s
    cols = [*CHAT_KEYS, "compaction_count", "compaction_time_s", "stall_share", "e2e_s", "reused_chunks", "answer_f1"]
    table = chat[cols].rename(columns={"compaction_time_s": "stall_s"})
    return table.sort_values(CHAT_KEYS, na_position="first").reset_index(drop=True)


def quality(rows: pd.DataFrame) -> pd.DataFrame:
    """Answer quality per agent configuration (judge accuracy over parsed verdicts only)."""
    asked = rows[(rows.event == "turn") & (rows.step == "question")].copy()
    if asked.empty:
        return pd.DataFrame()
    asked["judge_parsed"] = asked.judge_correct.notna()
    asked["judge_hit"] = asked.judge_correct.astype("boolean").astype(float)
    table = asked.groupby(["experiment", *AGENT_KEYS, "tau"], dropna=False).agg(
        questions=("cell_id", "size"),
        em=("em", "mean"),
        f1=("f1", "mean"),
        mc_accuracy=("mc_correct", lambda s: s.dropna().astype(float).mean() if s.notna().any() else None),
        judge_accuracy=("judge_hit", "mean"),
        judge_parsed=("judge_parsed", "sum"),
        judge_is_agent=("judge_is_agent_model", "max"),
    )
    return table.reset_index()


RETENTION_KEYS = [
    "model",
    "dataset",
    "strategy",
    "option_set",
    "layout",
    "chunk_tokens",
    "variant",
    "grounding_threshold",
]
_SUMS = [
    "facts", "model_summaries", "summaries_ungrounded_first", "summaries_ungrounded_out", "salient_tokens_first",
    "ungrounded_tokens_first", "salient_tokens_out", "ungrounded_tokens_out", "fallback_chunks", "chunks",
]  # fmt: skip


def _share(part: pd.Series, whole: pd.Series) -> pd.Series:
    return part.astype(float) / whole.astype(float).where(whole > 0)


def retention(rows: pd.DataFrame) -> pd.DataFrame:
    """Per compaction setting: recall (exact, judged), summary volume, invented tokens before/after, fallbacks."""
    runs = rows[rows.event == "retention"].copy()
    if runs.empty:
        return pd.DataFrame()
    runs["summary_volume"] = runs.summary_tokens + runs.user_words_tokens.fillna(0)
    facts = rows[rows.event == "fact"].copy()
    facts["exact"] = facts.recalled_exact.astype(float)
    facts["judged"] = facts.judge_correct.astype("boolean").astype(float)
    recall = facts.groupby(RETENTION_KEYS, dropna=False).agg(
        recall_exact=("exact", "mean"),
        recalled=("exact", "sum"),
        recall_judged=("judged", "mean"),
        judge_is_agent=("judge_is_agent_model", "max"),
    )
    table = runs.groupby(RETENTION_KEYS, dropna=False).agg(
        histories=("cell_id", "size"),
        summary_tokens=("summary_tokens", "mean"),
        summary_volume=("summary_volume", "mean"),
        repeated_sentences=("repeated_sentences", "sum"),
        latency_s=("compaction_latency_s", "mean"),
        **{c: (c, "sum") for c in _SUMS},
    )
    table = table.join(recall).reset_index()
    table["invented_summaries_before"] = _share(table.summaries_ungrounded_first, table.model_summaries)
    table["invented_summaries_after"] = _share(table.summaries_ungrounded_out, table.model_summaries)
    table["invented_tokens_before"] = _share(table.ungrounded_tokens_first, table.salient_tokens_first)
    table["invented_tokens_after"] = _share(table.ungrounded_tokens_out, table.salient_tokens_out)
    table["fallback_rate"] = _share(table.fallback_chunks, table.model_summaries)
    keep = [*RETENTION_KEYS, "histories", "facts", "recalled", "recall_exact", "recall_judged", "summary_tokens"]
    keep += ["summary_volume", "repeated_sentences", "latency_s"]
    keep += ["invented_summaries_before", "invented_summaries_after", "invented_tokens_before"]
    keep += ["invented_tokens_after", "fallback_rate", "judge_is_agent"]
    return table[keep]


def retention_by_kind(rows: pd.DataFrame) -> pd.DataFrame:
    """Exact recall per kind of fact (columns) and compaction setting (rows)."""
    facts = rows[rows.event == "fact"].copy()
    if facts.empty:
        return pd.DataFrame()
    facts["exact"] = facts.recalled_exact.astype(float)
    keys = ["dataset", "strategy", "option_set", "layout", "chunk_tokens", "grounding_threshold"]
    facts["option_set"] = facts.option_set.fillna("")
    table = facts.pivot_table(index=keys, columns="fact_kind", values="exact", aggfunc="mean", dropna=False)
    return table.dropna(how="all").reset_index().rename_axis(columns=None)


def load_rows(results: Path) -> tuple[pd.DataFrame, dict[str, int]]:
    table = ResultStore(results).read()
    if table.num_rows == 0:
        raise SystemExit(f"no results in {results / 'cells'}; run jobs/sweep.py first")
    integers = {pa.int32(): pd.Int64Dtype(), pa.int64(): pd.Int64Dtype()}
    return table.to_pandas(types_mapper=integers.get), integrity(table)  # nullable integers stay integers


def write_report(results: Path, out: Path) -> Path:
    rows, counts = load_rows(results)
    out.mkdir(parents=True, exist_ok=True)
    runs = episodes(rows)
    sections = {
        "output_length": output_length(rows),
        "stability": stability(rows),
        "tau": tau_table(runs),
        "chunking": chunk_table(runs),
        "chat_agent": chat_agent_table(rows, runs),
        "quality": quality(rows),
        "retention": retention(rows),
        "retention_by_kind": retention_by_kind(rows),
    }
    figures = {
        "output_length": plot_output_length,
        "tau": plot_tau,
        "chunking": plot_chunks,
        "chat_agent": plot_chat_agent,
        "retention": plot_retention,
    }
    for name, plot in figures.items():
        if not sections[name].empty:
            plot(sections[name], out / f"{name}.png")
    text = render(results, rows, counts, sections, {n for n in figures if (out / f"{n}.png").exists()})
    report = out / "report.md"
    report.write_text(text)
    return report


TITLES = {
    "output_length": "(a) Summary output tokens vs input length, per instruction variant",
    "stability": "(b) Run-to-run stability of repeated summaries",
    "tau": "(c) Compaction share of end-to-end time and compaction count vs τ",
    "chunking": "(d) Parallel vs sequential over chunk sizes at matched decode volume",
    "chat_agent": "The agent through the chat endpoint: stall per compaction mode (server-side compaction)",
    "quality": "Answer quality",
    "retention": "Retention: recall of known facts and invented salient tokens, per strategy",
    "retention_by_kind": "Retention: exact recall per kind of fact",
}
NOTES = {
    "stability": "CV = sample standard deviation / mean of summary tokens; ROUGE-L = mean F1 over all pairs.",
    "chunking": "throughput = input tokens compacted per second of compaction; volume = summary tokens kept.",
    "chat_agent": "stall_s: the agent-visible wait for compaction, summed over the run (blocking: every "
    "compaction; background: what was left of it when the turn crossed τ); reused_chunks: chunk summaries "
    "served from the chunk cache.",
    "quality": "Judge accuracy counts parsed verdicts only; judge_is_agent marks a judge that is the agent model.",
    "retention": "recall_exact: the fact's string occurs in the compacted history (recalled: how many facts); "
    "summary_volume: tokens of the summaries plus the user's words kept verbatim; repeated_sentences: sentences "
    "of the summaries repeating an earlier one (over all histories); recall_judged: the agent answered "
    "the fact's question from it and the judge agreed (parsed verdicts only; judge_is_agent marks a judge that is "
    "the agent model). invented_*: share of model summaries (or of their salient tokens) stating a salient token "
    "found nowhere in their source, in the first attempt (before) and in the text kept (after the grounding check); "
    "a retry after an empty or runaway first attempt is not in 'before', so the rows with grounding_threshold 0 "
    "(no check) are the figure without the check. fallback_rate: share of model summaries replaced by the "
    "extractive summary.",
}


def render(results: Path, rows: pd.DataFrame, counts: dict, sections: dict, figures: set[str]) -> str:
    lines = [
        f"# Benchmark report: {results.name}",
        "",
        f"Results: `{results}` — {counts['rows']} rows in {counts['cells']} cells; duplicate rows "
        f"{counts['duplicate_rows']}; agent cells with missing turns {counts['agent_cells_with_turn_gaps']}.",
        f"Models: {', '.join(sorted(rows.model.unique()))}; served by: {', '.join(sorted(rows.backend.unique()))}.",
        "Times are wall-clock seconds on the machine that ran the sweep.",
    ]
    for name, frame in sections.items():
        lines += ["", f"## {TITLES[name]}", ""]
        if name in figures:
            lines += [f"![{name}]({name}.png)", ""]
        if name in NOTES:
            lines += [NOTES[name], ""]
        lines.append(markdown(frame))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="A sweep's results folder (the one holding cells/)")
    parser.add_argument("--out", type=Path, default=None, help="Where to write report.md and the PNGs")
    parser.add_argument("--show", choices=["retention"], default=None, help="Also print this section's tables")
    args = parser.parse_args(argv)
    report = write_report(args.results.resolve(), (args.out or args.results / "report").resolve())
    print(f"wrote {report}")
    if args.show == "retention":
        rows, _ = load_rows(args.results.resolve())
        print(f"\n{TITLES['retention']}\n{markdown(retention(rows))}")
        print(f"\n{TITLES['retention_by_kind']}\n{markdown(retention_by_kind(rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
