"""The simulator's report: the fleet table (per policy, blocking vs background), the paper's Table 2 shape, plots.

python -m jobs.sim report results/sim-h100-fleet results/sim-h100-tau [--out DIR]
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from jobs.experiments.results import ResultStore
from jobs.report import markdown
from jobs.sim.grid import SCHEMA

FLEET_COLUMNS = {
    "turn_latency_mean_s": "turn s",
    "compaction_throughput_tok_s": "compaction tok/s",
    "stall_mean_s": "stall s/compaction",
    "compaction_share": "stall share",
    "cache_hit_share": "cache hits",
    "compaction_cache_hit_share": "compaction cache hits",
    "replica_utilisation": "replica busy",
}


def load(results: list[Path]) -> pd.DataFrame:
    frames = [ResultStore(r, SCHEMA).read().to_pandas() for r in results]
    rows = (
        pd.concat([f for f in frames if not f.empty], ignore_index=True) if any(not f.empty for f in frames) else None
    )
    if rows is None:
        raise SystemExit(f"no results in {', '.join(map(str, results))}; run `python -m jobs.sim grid` first")
    return rows


def fleet_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Runs with several replicas: one line per (replicas, sessions, mode, policy)."""
    fleet = rows[(rows.sessions > 1) & (rows.tool_model != "codex")]
    keys = ["profile", "replicas", "sessions", "mode", "policy"]
    table = fleet[keys + list(FLEET_COLUMNS)].sort_values(keys).rename(columns=FLEET_COLUMNS)
    return table.reset_index(drop=True)


def fleet_pivot(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (replicas, sessions, mode); per policy: stall per compaction, chunk-prompt cache hits,
    compaction throughput; and the agents' mean turn latency (auto) to show saturation."""
    fleet = rows[(rows.sessions > 1) & (rows.tool_model != "codex")].copy()
    fleet["cell"] = (
        fleet.stall_mean_s.map("{:.1f} s".format)
        + " · "
        + (100 * fleet.compaction_cache_hit_share).map("{:.0f} %".format)
        + " · "
        + (fleet.compaction_throughput_tok_s / 1000).map("{:.1f}k".format)
    )
    keys = ["replicas", "sessions", "mode"]
    table = fleet.pivot_table(index=keys, columns="policy", values="cell", aggfunc="first")
    turn = fleet[fleet.policy == "auto"].set_index(keys).turn_latency_mean_s.map("{:.1f} s".format)
    return table.join(turn.rename("turn (auto)")).reset_index()


def agents_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Fleets of agents with Codex tool time: per (replicas, sessions) and run (blocking, background at equal
    priority, background yielding), end to end per turn, stall per compaction, turn latency, and the turn p95 over
    blocking's (what background work costs the agents' turns)."""
    part = rows[(rows.tool_model == "codex") & (rows.sessions > 1)].copy()
    if part.empty:
        return pd.DataFrame()
    kind = part.yielding.map({True: "background, yielding", False: "background, equal priority"})
    if "background_beside_tokens" in part and part.background_beside_tokens.notna().any():
        beside = part.background_beside_tokens.fillna(0).astype(int)
        kind = kind.where(~part.yielding, kind + ", " + beside.astype(str) + " beside")
    part["run"] = part["mode"].where(part["mode"] == "blocking", kind)
    part = part.drop_duplicates(["replicas", "sessions", "run"])  # blocking has no background work to yield
    blocking = part[part.run == "blocking"].set_index(["replicas", "sessions"]).turn_latency_p95_s
    part["turn p95 / blocking"] = part.apply(lambda r: r.turn_latency_p95_s / blocking[(r.replicas, r.sessions)], 1)
    columns = {
        "e2e_per_turn_s": "end to end per turn s", "stall_mean_s": "stall s/compaction",
        "turn_latency_p50_s": "turn p50 s", "turn_latency_p95_s": "turn p95 s", "compactions": "compactions",
    }  # fmt: skip
    keys = ["replicas", "sessions", "run"]
    table = part[keys + list(columns) + ["turn p95 / blocking"]].rename(columns=columns)
    return table.sort_values(keys).reset_index(drop=True)


def tau_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Single-agent runs: compaction share of end-to-end time per model, strategy and tau."""
    single = rows[rows.sessions == 1]
    if single.empty:
        return pd.DataFrame()
    share = single.pivot_table(index=["profile", "strategy"], columns="tau", values="compaction_share")
    share.columns = [f"τ={int(t) // 1024}k" for t in share.columns]
    return (100 * share).round(1).reset_index()


def plot_fleet(table: pd.DataFrame, path: Path) -> None:
    replicas = sorted(table.replicas.unique())
    fig, axes = plt.subplots(1, len(replicas), figsize=(4 * len(replicas), 3.6), sharey=True, squeeze=False)
    for ax, count in zip(axes[0], replicas, strict=True):
        part = table[table.replicas == count]
        for (mode, policy), group in part.groupby(["mode", "policy"]):
            style = "-" if mode == "background" else "--"
            ax.plot(group.sessions, group["stall s/compaction"], style, marker="o", label=f"{policy}, {mode}")
        ax.set(xscale="log", xlabel="concurrent agent sessions", title=f"{count} replicas")
        ax.set_yscale("symlog", linthresh=1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("agent stall per compaction (s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tau(rows: pd.DataFrame, path: Path) -> None:
    single = rows[rows.sessions == 1].sort_values("tau")
    fig, ax = plt.subplots(figsize=(6, 4))
    for (profile, strategy), group in single.groupby(["profile", "strategy"]):
        style = "-" if strategy == "parallel" else "--"
        ax.plot(group.tau / 1024, 100 * group.compaction_share, style, marker="o", label=f"{profile}, {strategy}")
    ax.set(xlabel="τ (k tokens)", ylabel="compaction share of end-to-end time (%)", ylim=(0, None))
    ax.set_title("Simulated on H100: one agent, one replica")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: list[Path], out: Path) -> Path:
    rows = load(results)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Simulator report", "", f"Results: {', '.join(f'`{r}`' for r in results)}; {len(rows)} runs."]
    fleet = fleet_table(rows)
    if not fleet.empty:
        plot_fleet(fleet, out / "fleet.png")
        lines += ["", "## Fleets: per placement policy, blocking vs background", "", "![fleet](fleet.png)", ""]
        lines += ["Per policy: stall per compaction · chunk-prompt cache hits · compaction tokens/s.", ""]
        lines += [markdown(fleet_pivot(rows)), "", markdown(fleet, digits=3)]
    agents = agents_table(rows)
    if not agents.empty:
        lines += ["", "## Agents with Codex tool time: blocking vs background, equal priority or yielding", ""]
        lines += [markdown(agents, digits=2)]
    taus = tau_table(rows)
    if not taus.empty:
        plot_tau(rows, out / "tau.png")
        lines += ["", "## Compaction share of end-to-end time (%) vs τ (the paper's Table 2 shape)", ""]
        lines += ["![tau](tau.png)", "", markdown(taus, digits=1)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report
