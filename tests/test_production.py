"""Production traffic through the shared real service: queueing, shared runs, deadlines, cancellation, metrics.

The `service` fixture runs with small admission limits (conftest: `SERVICE_LIMITS`), so a burst of
cheap compactions shows the queue and the 429s. Engine and compaction metrics are read from Ray's
metrics endpoint (the test cluster exports every second).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import psutil
import pytest

from jobs.bench.processes import service_processes
from serving.local import APP_NAME, CONTROL_ENV, LocalService
from serving.models import CPU_ENGINE_ENV
from tests.support import SERVED_MODEL, SERVICE_LIMITS, auth, samples, scrape

pytestmark = [pytest.mark.ray, pytest.mark.engine]

MODEL = SERVED_MODEL


def cheap(text: str = "I booked a flight to Oslo for the 14th.", **options: Any) -> dict[str, Any]:
    """A compaction that costs one short prompt and a few output tokens, of a history its summary shortens (the
    assistant's replies are summarised; the user's words are kept)."""
    reply = "Noted. I wrote it down with the date, the booking reference and the seat, and I will remind you later."
    messages = [{"role": role, "content": f"{text} (note {i})" if role == "user" else reply}
                for i in range(4) for role in ("user", "assistant")]  # fmt: skip
    return {"model": MODEL, "messages": messages, "strategy": "sequential", "max_chunk_summary_tokens": 6, **options}


def wait_for(check: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> float:
    """Seconds until `check()` held; raises after `timeout_s`."""
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - began


def held_still(read: Callable[[], float], seconds: float, timeout_s: float, poll_s: float = 0.25) -> float:
    """Seconds until `read()` last changed, once it has held one value for `seconds`; raises after `timeout_s`."""
    began = time.monotonic()
    value, since = read(), began
    while time.monotonic() - since < seconds:
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"still changing after {timeout_s} s (now {value})")
        time.sleep(poll_s)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return since - began


def engine_running(metrics_url: str) -> float:
    """Requests the engines are running (vLLM's gauge; a replica that stopped reporting counts 0)."""
    return sum(samples(scrape(metrics_url), "ray_vllm_num_requests_running"))


def engine_generated(metrics_url: str) -> float:
    """Tokens the engines have generated so far (vLLM's counter)."""
    return sum(samples(scrape(metrics_url), "ray_vllm_generation_tokens_total"))


def test_metrics_are_exported_on_rays_endpoint_after_a_compaction(client: httpx.Client, metrics_url: str) -> None:
    body = cheap("The metrics test compacts this.", strategy="parallel", chunk_tokens=128)
    response = client.post("/v1/compact", json=body)
    assert response.status_code == 200, response.text
    stats = response.json()["stats"]
    ok = {"model": MODEL, "strategy": "parallel", "outcome": "ok"}
    wait_for(lambda: sum(samples(scrape(metrics_url), "ray_compaction_requests_total", **ok)) >= 1, 30)
    text = scrape(metrics_url)
    print("\n".join(line for line in text.splitlines() if line.startswith("ray_compaction_"))[:4000])
    assert sum(samples(text, "ray_compaction_latency_seconds_count", model=MODEL)) >= 1
    assert sum(samples(text, "ray_compaction_queue_wait_seconds_count", model=MODEL)) >= 1
    assert sum(samples(text, "ray_compaction_chunks_count", model=MODEL)) >= 1  # (Ray's _sum is bucket midpoints)
    computed = sum(samples(text, "ray_compaction_prompt_tokens_total", model=MODEL, source="computed"))
    cached = sum(samples(text, "ray_compaction_prompt_tokens_total", model=MODEL, source="cached"))
    assert computed + cached >= stats["prompt_tokens"] > 0
    assert sum(samples(text, "ray_compaction_input_tokens_total", model=MODEL)) >= stats["input_tokens"]
    assert samples(text, "ray_compaction_running", model=MODEL)  # the gauge exists; its value moves


async def test_a_burst_queues_then_sheds_and_identical_requests_run_once(service: LocalService) -> None:
    """Without a session id, calls alternate between the two coordinators; each runs
    `admission.max_running` and queues `admission.max_queued`, then answers 429."""
    per_coordinator = SERVICE_LIMITS["max_running"] + SERVICE_LIMITS["max_queued"]
    burst = 64  # against 2 x (4 running + 8 queued) admitted at most
    session = f"dedup-{uuid.uuid4().hex[:6]}"

    def distinct(i: int) -> dict[str, Any]:
        """The same history but its last user message: the queued ones find the rest in the prefix cache."""
        body = cheap()
        body["messages"][-2] = {"role": "user", "content": f"Burst request {i}."}
        return body

    async with httpx.AsyncClient(base_url=service.url, headers=auth(), timeout=600) as http:
        replies = await asyncio.gather(*(http.post("/v1/compact", json=distinct(i)) for i in range(burst)))
        codes = [r.status_code for r in replies]
        print(f"burst of {burst}: {codes.count(200)} x 200, {codes.count(429)} x 429")
        assert (
            set(codes) <= {200, 429}
            and codes.count(429) >= burst - 2 * per_coordinator - 8
            and codes.count(200) <= 2 * per_coordinator + 8
        )
        for refused in (r for r in replies if r.status_code == 429):
            assert int(refused.headers["retry-after"]) >= 1
            assert "admission.max_queued" in refused.json()["error"]["message"]
        waits = [r.json()["stats"]["queue_wait_s"] for r in replies if r.status_code == 200]
        assert max(waits) > 0 and all(w >= 0 for w in waits)

        same = cheap("Both callers ask for exactly this.", session_id=session)
        pair = await asyncio.gather(*(http.post("/v1/compact", json=same) for _ in range(2)))
    assert [r.status_code for r in pair] == [200, 200]
    first, second = (r.json() for r in pair)
    assert first["summary"] == second["summary"] and sorted([first["stats"]["shared"], second["stats"]["shared"]]) == [
        False,
        True,
    ]


def test_the_load_benchmark_drives_sessions_through_the_service(
    service: LocalService, locomo: list[dict[str, Any]], tokenizer: Any, tmp_path: Any
) -> None:
    """jobs/bench/load.py's library at a tiny level: two agent sessions (a turn, then a compaction), one figure."""
    from jobs.bench.load import plot
    from jobs.bench.traffic import make_sessions, run_level

    sessions = make_sessions(locomo, tokenizer, 2, 384, 1)
    assert len({s.history[0]["content"] for s in sessions}) == 2  # no shared prefix between sessions
    compaction = {"chunk_tokens": 256, "max_chunk_summary_tokens": 8}
    row = asyncio.run(run_level(service.url, sessions, MODEL, compaction))
    print(row)
    assert row["compactions"] == {"200": 2} and row["turns_ok"] == 2 and row["rejected_429"] == 0
    assert row["input_tokens_compacted"] > 0 and row["compaction_throughput_tok_s"] > 0
    assert 0 <= row["cache_hit_share"] <= 1 and row["compaction_p95_s"] >= row["compaction_p50_s"] > 0
    plot([{"mode": "agent", **row}], tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 0


def long_compaction(tokens: int = 2000, lines: int = 60, **extra: Any) -> dict[str, Any]:
    """A compaction that keeps both engines decoding for a while: every chunk summary is forced to `tokens` tokens
    (no pinned share, so the model decodes the whole budget). Long by construction: 2,000 decode steps take
    longer than any deadline below on any CPU (a step is tens of milliseconds on the fastest)."""
    text = " ".join(f"On day {i} the crew logged position {i * 7} and weather code {i % 5}." for i in range(lines))
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "Logged."}] * 2
    return {
        "model": MODEL, "messages": messages, "chunk_tokens": 256, "max_chunk_summary_tokens": tokens,
        "pinned_share": 0.0, "fixed_output_tokens": True, "placement": "spread", "reuse_chunks": False, **extra,
    }  # fmt: skip


@pytest.mark.parametrize("how", ["client disconnect", "deadline"])
async def test_abandoned_compactions_stop_on_the_engines(service: LocalService, metrics_url: str, how: str) -> None:
    assert await asyncio.to_thread(wait_for, lambda: engine_running(metrics_url) == 0, 120) >= 0
    body = long_compaction(**({"timeout_s": 8} if how == "deadline" else {}))
    async with httpx.AsyncClient(base_url=service.url, headers=auth(), timeout=600) as http:
        call = asyncio.create_task(http.post("/v1/compact", json=body))
        if how == "client disconnect":
            await asyncio.to_thread(wait_for, lambda: engine_running(metrics_url) > 0, 120)
            call.cancel()  # httpx closes the connection: the client is gone
        else:
            response = await call
            error = response.json()["error"]
            assert response.status_code == 504 and error["type"] == "timeout_error" and "timeout_s" in error["message"]
        at_leaving = engine_generated(metrics_url)
    took = await asyncio.to_thread(wait_for, lambda: engine_running(metrics_url) == 0, 30, 0.1)
    assert took <= 2.0 + 2.0  # 2 s, plus Ray's export of the gauge (1 s interval in the test cluster)
    # The engines stopped decoding: every chunk prompt asked for 2,000 tokens, so an engine still decoding one
    # would move the counter every step for minutes. It holds still for 3 s within a few s of the gauge at 0
    # (the counter, too, reaches the endpoint up to an export interval late).
    settled = await asyncio.to_thread(held_still, lambda: engine_generated(metrics_url), 3.0, 30.0)
    after = engine_generated(metrics_url) - at_leaving
    print(f"{how}: engine running requests at 0 {took:.2f} s after the client left; {after:.0f} tokens decoded since")
    assert settled <= 4.0 and after < 2000, (settled, after)


@pytest.mark.parametrize(
    ("role", "wanted"),
    [
        # serving.models CPU_ENGINE_ENV: without it, an engine serving prompts of every length grows with each new
        # batch shape (oneDNN's global primitive cache).
        ("engine", CPU_ENGINE_ENV),
        # serving.local CONTROL_ENV, from the cluster's runtime_env: Serve's control loop interval, the time a
        # starting HTTP proxy has to answer ready before Serve replaces it and `serve.start` fails, and how often
        # the replicas and handles hand Ray their request metrics.
        ("controller", CONTROL_ENV),
        ("ingress", CONTROL_ENV),
        ("coordinator", CONTROL_ENV),
    ],
)
def test_the_services_processes_have_the_environment_they_are_tuned_by(
    client: httpx.Client, role: str, wanted: dict[str, str]
) -> None:
    """Each process of the role (the replicas' engines in processes of their own; Serve's controller and the
    application's replicas) reads the settings from its environment."""
    assert client.get("/healthz").status_code == 200
    processes = [p for p in service_processes() if p.role == role and (role != "engine" or p.node_id is not None)]
    assert processes, f"no {role} process found among the service's"
    for process in processes:
        env = psutil.Process(process.pid).environ()
        assert {name: env.get(name) for name in wanted} == wanted, process


def ask_coordinators(question: Callable[[Any], Any]) -> dict[str, Any]:
    """Replica id -> `question(replica)` asked in each live coordinator replica's process."""
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#Coordinator#"
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    answers = {}
    for actor in named:
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        answers[actor["name"].removeprefix(prefix)] = ray.get(handle.__ray_call__.remote(question), timeout=30)
    return answers


def test_the_coordinators_import_neither_vllm_nor_ray_serve_llm(client: httpx.Client) -> None:
    """A coordinator sends its chunk prompts and reads their answers as plain dicts (serving.replica_backend,
    serving.placement.CompactionLLMServer): vLLM and ray.serve.llm stay out of it (12 s of CPU to import, and
    about 150 MiB, for each coordinator replica)."""
    for i in range(4):  # sessions on both coordinators
        assert client.post("/v1/compact", json=cheap(session_id=f"lean-{i}")).status_code == 200
    loaded = ask_coordinators(lambda _: [m for m in ("vllm", "ray.serve.llm") if m in sys.modules])
    assert len(loaded) == 2 and all(names == [] for names in loaded.values()), loaded


@pytest.mark.destructive
def test_a_coordinator_killed_during_a_compaction(client: httpx.Client, metrics_url: str) -> None:
    session = f"kill-{uuid.uuid4().hex[:6]}"
    warm = client.post("/v1/compact", json=cheap("Which coordinator is home?", session_id=session))
    home = warm.json()["stats"]["coordinator"]
    pids = ask_coordinators(lambda _: os.getpid())
    assert len(pids) == 2 and home in pids, (home, pids)

    async def kill_during(tokens: int) -> httpx.Response | None:
        """Kills the home coordinator while a compaction of `tokens` forced tokens a chunk runs on the engines and
        returns its answer; None if it finished before the engines' gauge showed it (too short for this CPU)."""
        await asyncio.to_thread(wait_for, lambda: engine_running(metrics_url) == 0, 120)
        async with httpx.AsyncClient(base_url=client.base_url, headers=auth(), timeout=600) as http:
            body = long_compaction(tokens, lines=12, session_id=session)
            task = asyncio.create_task(http.post("/v1/compact", json=body))
            await asyncio.to_thread(wait_for, lambda: task.done() or engine_running(metrics_url) > 0, 120)
            if task.done():
                return None
            os.kill(pids[home], signal.SIGKILL)
            return await task

    # Long by measurement: the work doubles until it is still running when the kill comes, on any CPU.
    response = next(r for r in (asyncio.run(kill_during(2**k)) for k in range(6, 12)) if r is not None)
    print(f"killed coordinator {home} (pid {pids[home]}): {response.status_code} {response.text[:200]}")
    if response.status_code == 503:
        assert int(response.headers["retry-after"]) >= 1
    else:
        assert response.status_code == 200, response.text
        assert response.json()["stats"]["coordinator"] != home  # retried on the live one
    assert "Actor" not in response.text and "Traceback" not in response.text
    after = client.post("/v1/compact", json=cheap("And the next request?", session_id=session))
    assert after.status_code == 200, after.text
    assert client.get("/healthz").status_code == 200
