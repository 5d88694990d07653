"""The in-process engine's own processes end with the program that started it, a SIGTERM included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.own_engine]

PROGRAM = """
import sys, time
from serving.backends import VLLMBackend
if __name__ == "__main__":
    backend = VLLMBackend.start(sys.argv[1], max_model_len=1024, kv_cache_gib=1)
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_sigterm_ends_the_engine_process_too(model_path: Path, tmp_path: Path) -> None:
    script = tmp_path / "hold_engine.py"
    script.write_text(PROGRAM)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "VLLM_LOGGING_LEVEL": "ERROR"}
    command = [sys.executable, str(script), str(model_path)]
    program = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        assert program.stdout is not None and program.stdout.readline().strip() == "ready"
        children = psutil.Process(program.pid).children(recursive=True)
        assert children, "vLLM runs its engine core in a child process"
        program.send_signal(signal.SIGTERM)
        status = program.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"engine processes left behind: {[c.name() for c in alive]}"
        assert status == 128 + signal.SIGTERM  # an ordinary exit (finally blocks ran), not death by the signal
    finally:
        for process in [*children, program]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                process.kill()
