"""The per-test prefill report's reading of vLLM's counters and running requests (tests/prefill_report.py)."""

from __future__ import annotations

from tests.prefill_report import engine_counters

TEXT = """\
# HELP ray_vllm_prompt_tokens_total Number of prefill plus cached tokens processed.
ray_vllm_prompt_tokens_total{ReplicaId="a",engine="0",model_name="m"} 1200.0
ray_vllm_prompt_tokens_total{ReplicaId="b",engine="0",model_name="m"} 800.0
ray_vllm_prompt_tokens_cached_total{ReplicaId="a",engine="0",model_name="m"} 512.0
ray_vllm_request_prompt_tokens_sum{ReplicaId="a",engine="0",model_name="m"} 99999.0
ray_vllm_generation_tokens_total{ReplicaId="b",engine="0",model_name="m"} 64.0
ray_vllm_num_requests_running{ReplicaId="a",engine="0",model_name="m"} 3.0
ray_vllm_num_requests_running{ReplicaId="b",engine="0",model_name="m"} 1.0
"""


def test_the_readings_are_summed_over_replicas_and_only_these_series_are_read() -> None:
    assert engine_counters(TEXT) == {"prompt": 2000.0, "cached": 512.0, "generated": 64.0, "running": 4.0}
    assert engine_counters("") == {"prompt": 0.0, "cached": 0.0, "generated": 0.0, "running": 0.0}
