"""The agent-loop benchmark: one agent through `/v1/chat/completions`, compaction done server-side, per mode.

    python -m jobs.bench.agent [--dataset locomo|hotpotqa] [--limit 12] [--tau 4096] [--background 2560]
                               [--modes none,blocking_sequential,blocking_parallel,background_parallel,rolling_parallel]
                               [--tool-time codex|SECONDS] [--rounds 1] [--url URL | --port 8000]
                               [--out results/bench-agent]

Starts the service (or uses a running one with --url) and plays the same stream of steps (a LoCoMo
conversation's sessions with their questions, or HotpotQA paragraphs and questions: one document per
turn, each question after its evidence) once per mode, side by side, each on emptied prefix caches
when the service is ours (see `jobs.agent.chat_loop` for the modes). After every turn the agent runs
its tools for a while (`--tool-time`: by default drawn from a fit to real Codex tool calls,
`jobs.agent.tools`; the same draws in every mode; `0` plays the turns back to back). Prints per mode:
end-to-end time, tool time, the agent-visible stall (total and worst), p50/p95 latency of the turns
that applied no compaction, the mean prompt a turn was answered from, compactions, prefill computed
vs cached (the agent's turns and the compactions), reused chunk summaries, given-up ones (a rolled
chunk whose background asking again a turn gave up), answer F1; then the ratios between modes.
`--rounds R` plays the modes R times on the same service, every other round in reverse order (A B, B A,
...): a machine whose speed drifts, or a mode that runs better first or second, then weighs on each
mode alike; each ratio is printed per round and as the median of the rounds.
Writes `<out>/bench_agent.json` (the first round's totals and turns, which `python -m jobs.sim replay`
reads; every round's totals, ratios and turns; the median ratios) and `<out>/bench_agent.png` (prompt size per
turn, end to end per mode, first round).

    python -m jobs.bench.agent --overhead [--history-tokens 7600] [--pairs 12]

measures instead what the threshold check costs a turn that does not compact: an agent turn on a
history of about 8k tokens sent with and without `context_management` (threshold above the
prompt), alternating which goes first, each pair on a new user message; median latency of each.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jobs.agent.chat_loop import MODES, ChatEpisode, LoopSettings, document_text, run_episode
from jobs.agent.pipeline import SYSTEM_PROMPT, question_prompt
from jobs.agent.tools import ToolTime
from jobs.bench.common import MODEL, local_service, replicas, sayer, table
from jobs.data.conversations import SHARED_DATA
from jobs.data.datasets import load_hotpotqa, load_locomo
from jobs.data.episodes import Question, Step, hotpotqa_steps, locomo_steps
from serving.local import quiet_http_clients
from serving.tenants import client_key

say = sayer("bench-agent")
WARM_TURNS = 10  # played once, blocking, before the first mode (the default trace compacts at its turn 8)


def load_steps(dataset: str, limit: int, data_dir: Path) -> list[Step]:
    if dataset == "hotpotqa":
        return hotpotqa_steps(load_hotpotqa(data_dir / "hotpotqa_dev_distractor_sample100.json")[:limit])
    return locomo_steps(load_locomo(data_dir / "locomo10.json")[:1], sessions=limit, questions_per_session=1)


def stream_tokens(steps: list[Step], tokenizer: Any, reply_tokens: int) -> int:
    """Tokens of the whole stream as one uncompacted history (the `none` mode's last prompt)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for step in steps:
        text = question_prompt(step) if isinstance(step, Question) else document_text(step)
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "x " * reply_tokens}]
    return len(tokenizer.encode(tokenizer.render(messages, add_generation_prompt=True)))


def system_tokens(tokenizer: Any) -> int:
    """Tokens of the agent's system message as the template renders it (what `jobs.sim replay` starts from)."""
    return len(tokenizer.encode(tokenizer.render([{"role": "system", "content": SYSTEM_PROMPT}])))


RATIOS = (
    ("e2e_s", "blocking_parallel"), ("e2e_s", "none"), ("mean_prompt_tokens", "blocking_parallel"),
    ("stall_s", "blocking_sequential"), ("stall_s", "blocking_parallel"), ("turn_p95_s", "blocking_parallel"),
)  # fmt: skip


def ratios(totals: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The background modes' figures over the other modes' (the benchmark's claims), where both ran."""
    out = {}
    for mode in ("background_parallel", "rolling_parallel"):
        for figure, other in RATIOS if mode in totals else ():
            if other in totals and totals[other][figure] > 0:
                out[f"{mode} {figure} / {other}"] = round(totals[mode][figure] / totals[other][figure], 3)
    return out


def plot(episodes: list[ChatEpisode], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (sizes, stalls) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    for episode in episodes:
        line = sizes.plot(
            [t.index for t in episode.turns], [t.answered_tokens for t in episode.turns], label=episode.mode
        )
        applied = [t for t in episode.turns if t.status == "applied"]
        sizes.scatter([t.index for t in applied], [t.answered_tokens for t in applied], color=line[0].get_color())
    sizes.set(xlabel="agent turn", ylabel="prompt tokens answered", title="Prompt size per turn (dots: compacted)")
    sizes.set_ylim(bottom=0)
    sizes.legend(fontsize=8)
    names = [e.mode.replace("_", "\n") for e in episodes]
    tools = [sum(t.tool_s for t in e.turns) for e in episodes]
    stalls.bar(names, [e.stall_s for e in episodes], color="tab:red", label="waiting for compaction")
    stalls.bar(
        names,
        [e.e2e_s - e.stall_s - tool for e, tool in zip(episodes, tools, strict=True)],
        bottom=[e.stall_s for e in episodes],
        color="tab:gray",
        label="agent turns",
    )
    stalls.bar(names, tools, bottom=[e.e2e_s - tool for e, tool in zip(episodes, tools, strict=True)],
               color="tab:olive", label="in its tools")  # fmt: skip
    stalls.set(ylabel="seconds", title="End-to-end time")
    stalls.tick_params(axis="x", labelsize=8)
    stalls.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from compaction.tokenizer import HFChatTokenizer
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    steps = load_steps(args.dataset, args.limit, args.data_dir)
    settings = LoopSettings(args.tau, args.background, args.chunk_tokens, args.summary_tokens, args.answer_tokens)
    whole = stream_tokens(steps, tokenizer, args.answer_tokens)
    chunks_hint = max(1, math.ceil(0.75 * args.tau / args.chunk_tokens))
    tools = args.tool_time.seconds(len(steps))
    say(
        f"{len(steps)} steps from {args.dataset}; the whole stream is {whole} tokens; tau {args.tau}; "
        f"tool time {args.tool_time.label()} ({sum(tools[:-1]):.1f} s in all)"
    )
    modes = [m for m in args.modes.split(",") if m]
    if "none" in modes and whole + args.answer_tokens > args.window:
        say(f"skipping mode none: the whole stream ({whole} tokens) does not fit the {args.window}-token window")
        modes.remove("none")
    rounds = with_service(
        args, lambda client, reset: play(client, reset, steps, modes, settings, chunks_hint, tools, args)
    )
    per_round = [{e.mode: e.totals() for e in episodes} for episodes in rounds]
    rows = [{"round": i, **row} for i, totals in enumerate(per_round) for row in totals.values()]
    print(table(rows, list(rows[0])))
    round_ratios = [ratios(totals) for totals in per_round]
    found = {name: round(statistics.median(r[name] for r in round_ratios), 3) for name in round_ratios[0]}
    for name, value in found.items():
        each = f" (rounds: {', '.join(f'{r[name]:.3f}' for r in round_ratios)})" if len(rounds) > 1 else ""
        print(f"{name} = {value:.3f}{each}")
    args.out.mkdir(parents=True, exist_ok=True)
    episodes, totals = rounds[0], per_round[0]
    record = {
        "settings": asdict(settings), "tool_time": args.tool_time.label(), "steps": len(steps),
        "stream_tokens": whole, "system_tokens": system_tokens(tokenizer), "totals": totals, "ratios": found,
        "keep_recent_tokens": kept_windows(settings, modes, chunks_hint),
        "rounds": [
            {"order": play_order(modes, i), "totals": t, "ratios": r,
             "turns": {e.mode: [asdict(turn) for turn in e.turns] for e in played}}
            for i, (t, r, played) in enumerate(zip(per_round, round_ratios, rounds, strict=True))
        ],
    }  # fmt: skip
    record["turns"] = record["rounds"][0]["turns"]
    (args.out / "bench_agent.json").write_text(json.dumps(record, indent=1, default=str))
    plot(episodes, args.out / "bench_agent.png")
    say(f"wrote {args.out / 'bench_agent.json'} and {args.out / 'bench_agent.png'}")
    return 0


def kept_windows(settings: LoopSettings, modes: list[str], hint: int) -> dict[str, int]:
    """Each compacting mode's keep_recent_tokens, as the service resolves its entry (`jobs.sim replay` reads them)."""
    from compaction.turn_policy import parse_context_management

    entries = {mode: parse_context_management([settings.entry(mode, hint)]) for mode in modes if mode != "none"}
    return {mode: entry.keep_recent_tokens for mode, entry in entries.items() if entry is not None}


def overhead(client: Any, history: list[dict[str, Any]], pairs: int, threshold: int) -> dict[str, float]:
    """Median latency of the same turns with and without a context_management entry that does not fire."""
    import statistics
    import time
    import uuid

    session = f"overhead-{uuid.uuid4().hex[:8]}"
    entry = {"context_management": [{"type": "compaction", "compact_threshold": threshold}]}
    timings: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(pairs + 1):
        messages = [*history, {"role": "user", "content": f"Turn {i}: what did they talk about last?"}]
        order = ("with", "without") if i % 2 else ("without", "with")
        for label in order:
            began = time.perf_counter()
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, temperature=0,
                extra_headers={"x-session-id": session}, extra_body=entry if label == "with" else {},
            )  # fmt: skip
            if i:  # the first pair only warms the cache
                timings[label].append(time.perf_counter() - began)
            if label == "with":
                assert (reply.model_extra or {}).get("compaction", {}).get("status") == "none"
        history = [*messages, {"role": "assistant", "content": "I see."}]
    plain, checked = statistics.median(timings["without"]), statistics.median(timings["with"])
    return {"turn_s": round(plain, 4), "with_check_s": round(checked, 4), "overhead": round(checked / plain - 1, 4)}


def run_overhead(args: argparse.Namespace) -> int:
    from compaction.tokenizer import HFChatTokenizer
    from jobs.data.conversations import locomo_messages, truncate_history
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    conversation = locomo_messages(json.loads((args.data_dir / "locomo10.json").read_text())[0])
    history = truncate_history(conversation, tokenizer, args.history_tokens)
    threshold = args.window - 64
    say(f"{len(history)} messages of about {args.history_tokens} tokens; {args.pairs} pairs of turns")
    found: dict[str, float] = {}

    def measure(client: Any, reset: Any) -> list[ChatEpisode]:
        found.update(overhead(client, history, args.pairs, threshold))
        return []

    with_service(args, measure)
    print(table([found], list(found)))
    print(f"threshold check: {100 * found['overhead']:.1f} % of the turn's latency")
    return 0


def play(
    client: Any,
    reset: Any,
    steps: list[Step],
    modes: list[str],
    settings: LoopSettings,
    hint: int,
    tools: list[float],
    args: Any,
) -> list[list[ChatEpisode]]:
    """Each round's episodes, in `modes` order (a round plays them reversed every other time). The first turns
    on a new engine are slower (a second more for the first), and so is its first compaction (a batch of new
    shapes): the stream's first turns, played once with blocking compaction, take that cost before the first
    mode plays."""
    say(f"warming the engine: the first {WARM_TURNS} turns with blocking compaction")
    run_episode(client, MODEL, args.dataset, steps[:WARM_TURNS], "blocking_parallel", settings, hint)
    rounds = []
    for i in range(args.rounds):
        episodes = {}
        for mode in play_order(modes, i):
            reset()
            at = f"round {i + 1} of {args.rounds}, " if args.rounds > 1 else ""
            say(f"{at}mode {mode}: {len(steps)} turns")
            episode = run_episode(client, MODEL, args.dataset, steps, mode, settings, hint, tools)
            stall, compactions = episode.stall_s, len(episode.compactions)
            say(f"{at}mode {mode}: {episode.e2e_s:.1f} s, stall {stall:.2f} s, {compactions} compactions")
            episodes[mode] = episode
        rounds.append([episodes[mode] for mode in modes])
    return rounds


def play_order(modes: list[str], index: int) -> list[str]:
    """The order round `index` plays the modes in: as given, reversed every other round."""
    return modes if index % 2 == 0 else modes[::-1]


def with_service(args: argparse.Namespace, body: Any) -> Any:
    """Run `body(openai_client, reset)` against --url, or a service started here (caches reset per mode)."""
    from openai import OpenAI

    # Like an agent: a 429/503 with Retry-After is retried (twice) after the wait it names; its time is in the turn.
    if args.url:
        client = OpenAI(base_url=f"{args.url}/v1", api_key=client_key() or "unused", max_retries=2, timeout=900)
        return body(client, lambda: None)
    service_args: dict[str, Any] = {
        **replicas(args.replicas),
        **({"catalogue": args.catalogue} if args.catalogue else {}),
    }
    with local_service(args.port, service_args) as (service, reset):
        client = OpenAI(base_url=f"{service.url}/v1", api_key=client_key() or "unused", max_retries=2, timeout=900)
        return body(client, reset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=("locomo", "hotpotqa"), default="locomo")
    parser.add_argument("--limit", type=int, default=12, help="LoCoMo sessions or HotpotQA examples")
    parser.add_argument("--data-dir", type=Path, default=SHARED_DATA)
    parser.add_argument("--tau", type=int, default=4096, help="compact_threshold of every compacting mode")
    parser.add_argument("--background", type=int, default=2560, help="background_threshold of the background modes")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--summary-tokens", type=int, default=32, help="per chunk; sequential gets the matched total")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--window", type=int, default=8192, help="the model window (for mode none)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--tool-time",
        default="codex",
        help="the agent's tool time after each turn: codex (fitted to real Codex tool calls, jobs.agent.tools; "
        "the default) or a fixed number of seconds (0: back to back)",
    )
    parser.add_argument("--tool-seed", type=int, default=0, help="seed of the tool-time draws")
    parser.add_argument(
        "--rounds", type=int, default=1, choices=range(1, 11), metavar="1..10",
        help="play the modes this many times, every other round in reverse order; ratios: the rounds' median",
    )  # fmt: skip
    parser.add_argument("--url", default=None, help="a running service (its caches are not reset)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=1, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--catalogue", help="the local service's model catalogue YAML (default: the packaged one)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-agent"))
    parser.add_argument("--overhead", action="store_true", help="measure the threshold check's cost instead")
    parser.add_argument("--history-tokens", type=int, default=7600, help="--overhead: the history size")
    parser.add_argument("--pairs", type=int, default=12, help="--overhead: turns measured each way")
    args = parser.parse_args(argv)
    quiet_http_clients()
    unknown = set(args.modes.split(",")) - set(MODES) - {""}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    try:
        args.tool_time = ToolTime.parse(args.tool_time, args.tool_seed)
    except ValueError as exc:
        parser.error(f"--tool-time: {exc}")
    return run_overhead(args) if args.overhead else run(args)


if __name__ == "__main__":
    sys.exit(main())
