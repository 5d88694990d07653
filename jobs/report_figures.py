"""The report's figures (jobs.report): one PNG per section, paper style."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

AGENT_KEYS = ["model", "dataset", "strategy", "chunk_tokens", "layout", "variant"]
SHAPE = ["model", "dataset", "tau", "variant"]


def plot_retention(table: pd.DataFrame, path: Path) -> None:
    """Exact recall vs summary volume (summaries plus the kept user words), one panel per domain."""
    datasets = sorted(table.dataset.unique())
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 4), sharey=True, squeeze=False)
    colours = {"parallel": "tab:blue", "sequential": "tab:orange", "extractive": "tab:green"}
    for axis, dataset in zip(axes[0], datasets, strict=True):
        for _, row in table[table.dataset == dataset].iterrows():
            named = isinstance(row.option_set, str) and row.option_set
            label = f"{row.strategy} ({row.option_set})" if named else str(row.strategy)
            colour = "tab:grey" if named else colours.get(row.strategy, "tab:purple")
            threshold = "" if pd.isna(row.grounding_threshold) else f" g{row.grounding_threshold:g}"
            axis.scatter(row.summary_volume, row.recall_exact, color=colour, s=50, alpha=0.85)
            axis.annotate(label + threshold, (row.summary_volume, row.recall_exact), fontsize=7,
                          xytext=(4, 3), textcoords="offset points")  # fmt: skip
        axis.set(title=dataset, xlabel="summary volume (tokens per compaction)", ylabel="exact recall")
        axis.set_ylim(-0.05, 1.05)
        axis.grid(alpha=0.3)
    _save(fig, path, "Retention: recall of planted facts vs summary volume, per strategy and domain")


def plot_output_length(table: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for (model, variant), group in table.groupby(["model", "variant"]):
        group = group.sort_values("target_input_tokens")
        ax.plot(group.input_tokens, group.output_tokens, marker="o", label=f"{variant} ({model})")
    ax.set(xlabel="input tokens compacted", ylabel="summary output tokens", title="(a) Output tokens vs input length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_tau(table: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    count_axis = ax.twinx()
    for key, group in table.groupby(AGENT_KEYS, dropna=False):
        label = f"{key[1]} {key[2]} B={key[3]}" if key[2] == "parallel" else f"{key[1]} sequential"
        line = ax.plot(group.tau, 100 * group.compaction_share, marker="o", label=f"{label} ({key[0]})")
        count_axis.plot(group.tau, group.compaction_count, ls=":", marker="x", color=line[0].get_color())
    ax.set(xlabel="τ (tokens)", ylabel="compaction share of end-to-end time (%)", title="(c) Time share vs τ")
    count_axis.set_ylabel("compactions (dotted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def plot_chat_agent(table: pd.DataFrame, path: Path) -> None:
    settings = table.groupby(["model", "dataset", "tau"], dropna=False)
    fig, axes = plt.subplots(1, settings.ngroups, figsize=(5 * settings.ngroups, 4), squeeze=False)
    for ax, ((model, dataset, tau), group) in zip(axes[0], settings, strict=True):
        labels = [
            f"{m}\nB={b}" if pd.notna(b) else str(m) for m, b in zip(group["mode"], group.chunk_tokens, strict=True)
        ]
        ax.bar(labels, group.stall_s, color="tab:red", label="waiting for compaction")
        ax.bar(labels, group.e2e_s - group.stall_s, bottom=group.stall_s, color="tab:gray", label="everything else")
        ax.set(ylabel="seconds", title=f"{dataset} τ={tau} ({model})")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=8)
    _save(fig, path, "The agent through /v1/chat/completions: end-to-end time and its stall, per compaction mode")


def plot_chunks(table: pd.DataFrame, path: Path) -> None:
    fig, (volume, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for key, group in table.groupby(SHAPE, dropna=False):
        name = f"{key[1]} τ={key[2]} ({key[0]})"
        par = group[group.strategy == "parallel"].sort_values("chunk_tokens")
        seq = group[group.strategy == "sequential"]
        for axis, column in ((volume, "summary_tokens_total"), (latency, "mean_compaction_s")):
            line = axis.plot(par.chunk_tokens, par[column], marker="o", label=f"parallel, {name}")
            for value in seq[column]:
                axis.axhline(value, ls="--", color=line[0].get_color(), label=f"sequential, {name}")
    volume.set(xlabel="chunk size B (tokens)", ylabel="summary tokens kept (all compactions)", title="Summary volume")
    latency.set(xlabel="chunk size B (tokens)", ylabel="seconds per compaction", title="Compaction latency")
    for axis in (volume, latency):
        axis.set_xscale("log", base=2)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    _save(fig, path, "(d) Parallel vs sequential over chunk sizes (matched decode volume)")


def _save(fig: Any, path: Path, title: str | None = None) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
