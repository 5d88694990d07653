"""Retention over a chain of compactions: typed canaries after each of 5 successive compactions, at a fixed budget.

    python -m jobs.bench.chain [--seeds 2] [--rounds 5] [--tokens-per-round 4000] [--budget 0.30]
                               [--methods tiers,summary,clearing,extractive,sequential] [--url URL]
                               [--out results/chain.parquet] [--plot docs/chain-retention.png]
    python -m jobs.bench.chain --report results/chain.parquet [more.parquet]     (the table and plot again)
    ray job submit --working-dir . -- python -m jobs.bench.chain --url http://<service>:8000

Sessions from `jobs.data.canary_sessions` (coding and data-analysis agents; a safety rule, a constraint, a fact in a
tool's output, a file modified, a decision and its reason, the next step and a task's status planted in round 1,
more in later rounds). Each round the agent's new turns are appended to the last compacted history and the
whole is compacted again through the service's `/v1/compact` (started here on 127.0.0.1 unless --url names one),
so every method carries what it kept into the next round. Methods:

- tiers: clearing auto, the state ledger, the archive (the tiered compaction);
- summary: parallel summaries only; extractive: the salient lines only, no model; sequential: one prompt;
- clearing: the tool output cleared, nothing summarised (not held to the budget: it cannot go below what the
  agent's words and calls take).

The budget: each round's compacted history at most `--budget` of the session's tokens so far (uncompacted). The
summaries' size is set per round from it (`max_chunk_summary_tokens`), and a result over it is compacted again
with a smaller one (at most twice). Per round: tokens, the share of the original, seconds, each current canary
kept or not, and for each one lost whether `search_history` over the service's MCP endpoint finds it in the
archive (tiers); salient tokens stated that the session never held (invented). Rows go to Parquet, the table and
a plot of survival per round to the paths given.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from compaction.history import parse_messages
from compaction.render import rendered_tokens
from compaction.tokenizer import ChatTokenizer, HFChatTokenizer
from jobs.bench.common import MODEL, free_port, local_service, mcp_calls, replicas, sayer, table
from jobs.data.canaries import KINDS, ChainSession, invented, session_text, survives
from jobs.data.canary_sessions import chain_session

say = sayer("chain")
# What the service writes that no session holds: stubs, cleared arguments, handles (not invented facts).
# A stub ends at its last `"]` (a quoted line may hold brackets), or at the line's end when a pinned copy is cut; a
# chunk border may have cut its opening "[tool output".
OURS = re.compile(
    r"(?:\[tool )?(?:output )?cleared to save context: [^\n]*?(?:\"\]|$)|\[cleared: \d+ chars|\barc-[0-9a-f]{24}\b",
    re.M,
)
CHUNK_TOKENS = 1024
KEEP_RECENT = 256
WORDS_SHARE, LEDGER_SHARE = 0.10, 0.15  # of the round's budget: the user's words, the ledger (tiers)
AIM = 0.9  # the first compaction of a round is sized for this share of the budget (the model's output varies)
RETRIES = 3  # compactions of a result still over the budget, each with summaries (and words) half as long
SEQUENTIAL_MOST = 1024  # one prompt over the whole history: its summary budget must leave it room in the window
METHODS: dict[str, dict[str, Any]] = {
    "tiers": {"clearing": "auto", "archive": True},
    "summary": {"clearing": "off"},
    "clearing": {"clearing": "only"},
    "extractive": {"strategy": "extractive", "clearing": "off"},
    "sequential": {"strategy": "sequential", "clearing": "off"},
}


def options(method: str, budget: int, history_tokens: int, scale: float) -> dict[str, Any]:
    """The method's options for a round whose compacted history may take `budget` tokens."""
    words = int(budget * WORDS_SHARE * scale)
    ledger = int(budget * LEDGER_SHARE) if method == "tiers" else 0  # never shrunk: what it drops is gone for good
    room = max(64, int((budget - words - ledger - KEEP_RECENT) * scale))
    chunks = 1 if method == "sequential" else max(1, math.ceil(history_tokens / CHUNK_TOKENS))
    per_chunk = max(16, room // chunks)
    return {
        **METHODS[method],
        "chunk_tokens": CHUNK_TOKENS,
        "max_chunk_summary_tokens": min(per_chunk, SEQUENTIAL_MOST) if method == "sequential" else per_chunk,
        "keep_recent_tokens": KEEP_RECENT,
        "carry_summary_tokens": 0,  # every earlier head is compacted again: the budget holds each round
        "user_words_tokens": words,
        "ledger_tokens": ledger,
    }


def around(text: str, tokens: Sequence[str], reach: int = 60) -> str:
    """Where each invented token first occurs in the compacted text, `reach` characters either side (to trace it)."""
    low = text.lower()
    spots = [(low.find(t), t) for t in tokens]
    return " | ".join(text[max(0, i - reach) : i + len(t) + reach].replace("\n", " ⏎ ") for i, t in spots if i >= 0)


async def compact(client: httpx.AsyncClient, messages: list[dict[str, Any]], opts: dict[str, Any], tools: Any) -> Any:
    body = {"model": MODEL, "messages": messages, "tools": tools, "session_id": None, **opts}
    answer = await client.post("/v1/compact", json=body, timeout=1800)
    if answer.status_code != 200:
        raise RuntimeError(f"/v1/compact answered {answer.status_code}: {answer.text[:300]}")
    return answer.json()


async def recallable(url: str, lost: Sequence[str]) -> list[bool]:
    """For each lost canary's first check, whether the archive's search_history finds a chunk holding it."""
    if not lost:
        return []
    _, results = await mcp_calls(url, None, *(("search_history", {"query": words, "limit": 3}) for words in lost))
    return [not r.is_error and q.lower() in str(r.content).lower() for r, q in zip(results, lost, strict=True)]


async def run_chain(
    client: httpx.AsyncClient, url: str, chain: ChainSession, method: str, fraction: float, tokenizer: ChatTokenizer
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = list(chain.system_and_first)
    for r in range(1, len(chain.rounds) + 2):
        if r > 1:
            history += chain.rounds[r - 2]
        original = chain.through(r)
        original_tokens = rendered_tokens(parse_messages(original), tokenizer, chain.tools)
        sent_tokens = rendered_tokens(parse_messages(history), tokenizer, chain.tools)
        budget = int(fraction * original_tokens)
        began, scale, attempts = time.perf_counter(), AIM, 0
        while True:
            attempts += 1
            try:
                result = await compact(client, history, options(method, budget, sent_tokens, scale), chain.tools)
            except RuntimeError as exc:  # e.g. sequential past the model window: the chain ends here
                say(f"{chain.kind}/{chain.seed} {method} round {r}: {exc}")
                return rows
            tokens = result["stats"]["compacted_tokens"]
            if tokens <= budget or method == "clearing" or attempts > RETRIES:
                break
            scale *= 0.5
        seconds = time.perf_counter() - began
        history = result["messages"]
        text = session_text(history)
        current = chain.current(r)
        kept = [survives(c, text) for c in current]
        lost = [c.checks[0] for c, k in zip(current, kept, strict=True) if not k]
        found = iter(await recallable(url, lost) if method == "tiers" else [False] * len(lost))
        made_up = invented(OURS.sub("", text), session_text(original))
        stats = result["stats"]
        for canary, survived in zip(current, kept, strict=True):
            rows.append({
                "kind": chain.kind, "seed": chain.seed, "method": method, "round": r, "canary": canary.kind,
                "planted_round": canary.round, "survived": survived,
                "recalled": survived or next(found), "original_tokens": original_tokens, "sent_tokens": sent_tokens,
                "compacted_tokens": tokens, "share": round(tokens / original_tokens, 4), "budget_tokens": budget,
                "seconds": round(seconds, 3), "attempts": attempts, "chunks": stats["chunks"],
                "cleared": stats["cleared_tool_outputs"], "ledger_entries": stats["ledger_entries"],
                "omissions_repaired": stats["omissions_repaired"], "invented": len(made_up),
                "invented_tokens": " ".join(made_up), "invented_context": around(text, made_up),
            })  # fmt: skip
        say(
            f"{chain.kind}/{chain.seed} {method:<10} round {r}: {tokens:>5} tokens ({tokens / original_tokens:.0%} of "
            f"{original_tokens}), {seconds:5.1f} s, kept {sum(kept)}/{len(kept)}, invented {len(made_up)}"
            + (f" ({' '.join(made_up)})" if made_up else "")
        )
    return rows


def summarise(rows: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """Per method: survival per canary type at rounds 1 and the last (round-1 canaries), size and time."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        line: dict[str, Any] = {"method": method}
        for kind in KINDS:
            for at in (1, rounds):
                cell = [r for r in mine if r["canary"] == kind and r["round"] == at]
                line[f"{kind}@{at}"] = f"{sum(r['survived'] for r in cell)}/{len(cell)}" if cell else "-"
        per_round = {(r["kind"], r["seed"], r["round"]): r for r in mine}.values()
        line["max_share"] = f"{max(r['share'] for r in per_round):.0%}"
        line["mean_s"] = round(sum(r["seconds"] for r in per_round) / len(per_round), 1)
        line["invented"] = sum(r["invented"] for r in per_round)
        line["recalled@last"] = sum(r["recalled"] for r in mine if r["round"] == rounds)
        line["kept@last"] = sum(r["survived"] for r in mine if r["round"] == rounds)
        out.append(line)
    return out


def sizes(rows: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """Per method: the largest compacted share of the original after each round."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        shares = {x: [r["share"] for r in mine if r["round"] == x] for x in range(1, rounds + 1)}
        out.append({"method": method, **{f"round {x}": f"{max(v):.0%}" if v else "-" for x, v in shares.items()}})
    return out


def plot(rows: list[dict[str, Any]], path: Path, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        xs = list(range(1, rounds + 1))
        at = [[r for r in mine if r["round"] == x] for x in xs]
        kept = [sum(r["survived"] for r in cell) / max(1, len(cell)) for cell in at]
        shares = [max((r["share"] for r in cell), default=0) for cell in at]
        left.plot(xs, kept, marker="o", label=method)
        right.plot(xs, shares, marker="o", label=method)
    left.set(xlabel="compaction round", ylabel="canaries kept", ylim=(0, 1.05), title="Canaries kept in the history")
    for axis in (left, right):
        axis.set_xticks(range(1, rounds + 1))
    right.set(xlabel="compaction round", ylabel="compacted / original tokens (max)", title="Size")
    right.axhline(0.30, color="grey", linestyle="--", linewidth=1)
    left.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def bench(url: str, args: argparse.Namespace, tokenizer: ChatTokenizer) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url) as client:
        for kind in ("coding", "analysis"):
            for seed in range(args.seeds):
                chain = chain_session(kind, seed, args.rounds, args.tokens_per_round, tokenizer)
                for method in args.methods.split(","):
                    rows += await run_chain(client, url, chain, method, args.budget, tokenizer)
    return rows


def main(argv: list[str] | None = None) -> int:
    from serving.weights import fetch

    parser = argparse.ArgumentParser(prog="python -m jobs.bench.chain", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="sessions of each kind (default 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens-per-round", type=int, default=4000)
    parser.add_argument("--budget", type=float, default=0.30, help="compacted share of the original, at most")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--url", default=None, help="a running service (default: start one here)")
    parser.add_argument("--out", type=Path, default=Path("results/chain.parquet"))
    parser.add_argument("--plot", type=Path, default=Path("docs/chain-retention.png"))
    parser.add_argument(
        "--report", type=Path, nargs="+", help="no run: the table and plot of these Parquet files (a method's rows "
        "from a later file replace an earlier file's)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.report:
        report(read_rows(args.report), args)
        return 0
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    tokenizer = HFChatTokenizer.from_path(fetch())
    if args.url:
        rows = asyncio.run(bench(args.url, args, tokenizer))
    else:
        with local_service(free_port(), replicas(1)) as (service, _):
            rows = asyncio.run(bench(service.url, args, tokenizer))
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.out)
    report(rows, args)
    say(f"rows: {args.out}")
    return 0


def read_rows(paths: Sequence[Path]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in paths:
        new = pq.read_table(path).to_pylist()
        methods = {r["method"] for r in new}
        rows = [r for r in rows if r["method"] not in methods] + new
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The survival table, the size per round, and the plot."""
    lines = summarise(rows, args.rounds)
    print(table(lines, list(lines[0])))
    print(f"\ncompacted share of the original after each round (largest over the sessions; budget {args.budget:.0%}):")
    shares = sizes(rows, args.rounds)
    print(table(shares, list(shares[0])))
    plot(rows, args.plot, args.rounds)
    say(f"plot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
