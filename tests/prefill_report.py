"""`pytest -p tests.prefill_report ...`: what each real-service test had the service's engines compute, costliest
first, at the end of the run. On a CPU without native bf16 the suite's time is mostly prefill (float32, about
200 tokens/s on two cores: docs/core.md), so this is the table to read before making a test cheaper.

vLLM's counters are read from Ray's metrics endpoint before the set-up and after the body of each test marked `ray`
(a module's fixture counts to its first test; a test whose set-up starts the session's cluster counts from when the
service is up). They reach it up to an export interval late, so each reading waits that long first (the run is
slower by about 2.5 s a test). Work a test leaves running (a background run still decoding) is counted to the
tests after it; the `busy` column (requests on the engines as the test's body began) points at the tests that
inherit such work, and a test that waits for idle engines waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import samples, scrape

EXPORT_S = 1.2  # the test cluster exports metrics every second
COUNTERS = {
    "prompt": "ray_vllm_prompt_tokens_total",
    "cached": "ray_vllm_prompt_tokens_cached_total",
    "generated": "ray_vllm_generation_tokens_total",
    "running": "ray_vllm_num_requests_running",  # a gauge: requests on the engines at the reading
}
ROWS = pytest.StashKey[list[tuple[int, int, int, int, float, str]]]()
BEFORE = pytest.StashKey[tuple[dict[str, float] | None, float]]()
SERVICE_UP = pytest.StashKey[tuple[dict[str, float] | None, float]]()


def engine_counters(text: str) -> dict[str, float]:
    """The engines' prompt, cached and generated token counters and running requests, summed over replicas,
    from Prometheus text."""
    return {key: sum(samples(text, name)) for key, name in COUNTERS.items()}


def read() -> dict[str, float] | None:
    """The counters now, or None before the session's Ray cluster is up."""
    import ray

    if not ray.is_initialized():
        return None
    time.sleep(EXPORT_S)
    ports = [node["MetricsExportPort"] for node in ray.nodes() if node["Alive"]]
    return engine_counters(scrape(f"http://127.0.0.1:{ports[0]}/metrics"))


def pytest_configure(config: pytest.Config) -> None:
    config.stash[ROWS] = []


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[Any]:
    """The counters as the session's service comes up, for the test whose set-up started it."""
    result = yield
    if fixturedef.argname == "service":
        request.config.stash[SERVICE_UP] = (read(), time.monotonic())
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """The counters before the test's fixtures are set up, so that the work of a module's fixture that plays
    sessions on the service (tests/test_agents.py) counts to its first test. Before the session's cluster is up
    there is nothing to read: then from the moment the service is up (its start is not counted)."""
    marked = item.get_closest_marker("ray") is not None
    if marked:
        item.stash[BEFORE] = (read(), time.monotonic())
    yield
    if marked and item.stash[BEFORE][0] is None:
        up = item.config.stash.get(SERVICE_UP, (None, 0.0))
        item.stash[BEFORE] = up if up[0] is not None else (read(), time.monotonic())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The counters when the test's body ends, passed or failed (before teardown: the last test's ends the
    session's cluster)."""
    try:
        yield
    finally:
        before, began = item.stash.get(BEFORE, (None, 0.0))
        after = read() if before is not None else None
        if before is not None and after is not None:
            delta = {key: round(after[key] - before[key]) for key in COUNTERS}
            computed, busy = delta["prompt"] - delta["cached"], round(before["running"])
            row = (computed, delta["prompt"], delta["generated"], busy, time.monotonic() - began)
            item.config.stash[ROWS].append((*row, item.nodeid))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    found = config.stash[ROWS]
    rows = sorted(found, reverse=True)
    if not rows:
        return
    write = terminalreporter.write_line
    in_all = f"{sum(r[0] for r in rows):,} prompt tokens computed, {sum(r[2] for r in rows):,} generated"
    write(f"\nthe service's engines, per test ({in_all}):")
    write(f"{'computed':>9} {'prompt':>8} {'generated':>9} {'busy':>4} {'s':>6}  test")
    for computed, prompt, generated, busy, seconds, name in rows[:30]:
        write(f"{computed:>9,} {prompt:>8,} {generated:>9,} {busy:>4} {seconds:>6.1f}  {name}")
    inherited = [row for row in found if row[3]]
    if inherited:
        write(f"\n{len(inherited)} tests began with requests on the engines (an earlier test's work, still running):")
        for *_, busy, _, name in inherited:
            write(f"{busy:>4}  {name}")
