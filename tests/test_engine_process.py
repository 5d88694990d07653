"""Engines of their own, in programs of their own, started once (as the session begins). One for three checks:
with a deliberately small KV cache an agent request that does not fit beside a held background request is still
served (no wedge); the program, hushed, and its engine print nothing of their start; the engine's processes end
with the program that started it, a SIGTERM included. The other, idle, for one: its engine's processes end when the
program is killed outright."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from serving.weights import model_dir

pytestmark = [pytest.mark.engine, pytest.mark.own_engine]

PROGRAM = '''
import asyncio, json, random, sys, time
from pathlib import Path

from compaction.backend import GenerationRequest
from compaction.pacing import AGENT, BACKGROUND
from jobs.sim.calibrate import model_facts
from serving.backends import VLLMBackend

BLOCK, BLOCKS = 128, 12  # a deliberately small KV cache: 1,536 tokens


def prompt(seed, tokens):
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(tokens)]


async def wedge(backend):
    """A background request holding 8 of the 12 blocks, decoding; then an agent request that needs 5. On the
    CPU a background request sits out every step an agent request waits: it would never free its blocks."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=120, min_tokens=120, temperature=0)
    stream = backend.engine.generate(TokensPrompt(prompt_token_ids=prompt(1, 900)), params, "bg", priority=BACKGROUND)
    await anext(stream)  # its prompt is prefilled: it holds its blocks

    async def rest():
        final = None
        async for final in stream:
            pass
        return final

    background = asyncio.ensure_future(rest())
    agent = GenerationRequest(tuple(prompt(2, 600)), max_tokens=8, min_tokens=8, request_id="agent", priority=AGENT)
    try:  # a wedge never answers: the bound only ends the program in that case
        answer = await asyncio.wait_for(backend.generate(agent), 300)
    except TimeoutError:
        return {"agent_output_tokens": 0, "background_output_tokens": None}
    final = await asyncio.wait_for(background, 300)
    return {"agent_output_tokens": answer.output_tokens, "background_output_tokens": len(final.outputs[0].token_ids)}


if __name__ == "__main__":
    from serving.local import hush

    hush()  # as the benchmarks start their engines: only errors, from this process and the engine's
    model = Path(sys.argv[1])
    kv_bytes = BLOCKS * BLOCK * model_facts(model)["kv_bytes_per_token"]
    backend = VLLMBackend.start(model, max_model_len=1024, block_size=BLOCK, kv_cache_memory_bytes=int(kv_bytes))
    print(json.dumps(None if sys.argv[2:] == ["idle"] else asyncio.run(wedge(backend))), flush=True)
    print("ready", flush=True)
    time.sleep(600)
'''


Program = tuple[subprocess.Popen[str], Any, Path]


def start_ahead(work: Path) -> Callable[[], tuple[Program, Program]]:
    """The programs, started as the session begins (tests/conftest.py `Ahead`): the one that runs the small-cache
    scenario and an idle one. Each as (its process, what the scenario returned, the file its stderr and its
    engine's go to), once it has printed it."""
    script = work / "hold_engine.py"
    script.write_text(PROGRAM)
    root = Path(__file__).resolve().parents[1]
    # The KV cache size is the engine argument's: VLLM_CPU_KVCACHE_SPACE (the session engine's) would override it.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env |= {"PYTHONPATH": str(root)}

    def start(*extra: str) -> tuple[subprocess.Popen[str], Path]:
        errors = work / f"stderr{''.join(extra)}"
        with errors.open("w") as stderr:
            command = [sys.executable, str(script), str(model_dir()), *extra]
            return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True), errors

    def started(process: subprocess.Popen[str], errors: Path) -> Program:
        assert process.stdout is not None
        return process, json.loads(process.stdout.readline() or "null"), errors

    def run() -> tuple[Program, Program]:
        scenario, idle = start(), start("idle")
        return started(*scenario), started(*idle)

    return run


def end(process: subprocess.Popen[str]) -> None:
    """Kill the process and whatever of its engine's processes is left."""
    children: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        children = psutil.Process(process.pid).children(recursive=True)
    for leftover in [*children, process]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            leftover.kill()


@pytest.fixture(scope="module")
def programs(model_path: Path, own_program: Any) -> Iterator[tuple[Program, Program]]:
    """The programs of `start_ahead`, ended with their engines' processes after the module's tests."""
    try:
        yield own_program
    finally:
        for process, _, _ in own_program:
            end(process)


@pytest.fixture(scope="module")
def program(programs: tuple[Program, Program]) -> Program:
    return programs[0]


def test_an_agent_request_that_does_not_fit_beside_held_background_work_is_served(
    program: Program,
) -> None:
    _, scenario, _ = program
    print(scenario)
    assert scenario == {"agent_output_tokens": 8, "background_output_tokens": 120}  # both served, in full


def test_a_hushed_program_and_its_engine_print_nothing_of_their_own_start(
    program: Program,
) -> None:
    """hush() as the benchmarks call it: no library warning (vLLM's about Triton, torch's NUMA binding) reaches the
    user from the engine's child processes, which start after it."""
    process, _, errors = program
    assert process.poll() is None  # started, ran the scenario, still running
    assert errors.read_text().splitlines() == []


def test_a_sigterm_ends_the_engine_process_too(program: Program) -> None:
    process, _, _ = program
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    children = psutil.Process(process.pid).children(recursive=True)
    assert children, "vLLM runs its engine core in a child process"
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes left behind: {[c.name() for c in alive]}"
    assert status == 128 + signal.SIGTERM  # an ordinary exit (finally blocks ran), not death by the signal


def test_an_engine_ends_with_its_program_killed_outright(programs: tuple[Program, Program]) -> None:
    """SIGKILL runs no handler: the engine core watches its parent (serving.scheduler.end_with_parent) and shuts
    itself and its workers down once the program is gone. Before, both stayed, holding about 3 GiB."""
    process, _, errors = programs[1]
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    children = psutil.Process(process.pid).children(recursive=True)
    assert any(c.name().startswith("VLLM::") for c in children), [c.name() for c in children]
    process.kill()
    process.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=90)  # the watch notices at once; the shutdown takes seconds
    assert not alive, f"engine processes left behind: {[c.name() for c in alive]}"
    assert errors.read_text().splitlines() == []
