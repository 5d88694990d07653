"""schemathesis against the live app's /openapi.json: no generated request gets a 5xx; errors have the route's shape.

Every generated request runs for real (compactions on the CPU model), so each is kept cheap: output
budgets are capped at a few tokens and no deadline is sent (a 504 the client asked for is not a
server fault). `FUZZ_EXAMPLES` bounds the examples per operation and mode (valid and invalid
requests); the count is printed.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from serving.local import LocalService
from tests.support import auth

pytestmark = [pytest.mark.ray, pytest.mark.engine]

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5"))
OPERATIONS = (
    r"^/(v1/compact|healthz|v1/models|v1/chat/completions|v1/completions|v1/responses|v1/messages"
    r"|v1/messages/count_tokens)$"
)
# Output-length fields of the operations, capped so a generated request costs a few decode steps.
CAPS = {"max_chunk_summary_tokens": 8, "max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 1,
        "best_of": 1}  # fmt: skip


# Set when absent: without them the engine decodes up to the whole window (minutes on the CPU), and
# the work would outlive the test.
DEFAULTS = {"/v1/compact": {"max_chunk_summary_tokens": 8}, "/v1/chat/completions": {"max_tokens": 4},
            "/v1/completions": {"max_tokens": 4}, "/v1/responses": {"max_output_tokens": 4}}  # fmt: skip


def cheapen(path: str, body: Any) -> None:
    if not isinstance(body, dict):
        return
    body.pop("timeout_s", None)
    for field, value in DEFAULTS.get(path, {}).items():
        if field not in body and not (field == "max_tokens" and "max_completion_tokens" in body):
            body[field] = value
    for field, cap in CAPS.items():
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            body[field] = max(0, min(body[field], cap))


def fuzz(url: str, examples: int) -> Counter[int]:
    """Every operation of the live schema, positive and negative cases; status counts. Asserts per request."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").include(path_regex=OPERATIONS)
    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def one(case: Any) -> None:
                cheapen(case.path, case.body)
                response = case.call(base_url=url, timeout=600, headers=auth())
                statuses[response.status_code] += 1
                where = (case.method, case.path, response.status_code, response.text[:300])
                assert response.status_code < 500, where
                if response.status_code >= 400:
                    error = response.json()["error"]
                    anthropic = case.path.startswith("/v1/messages")  # Anthropic's shape there, OpenAI's elsewhere
                    fields = {"message", "type"} if anthropic else {"message", "type", "param", "code"}
                    assert fields <= set(error) and error["message"], where
                    assert response.json().get("type") == "error" or not anthropic, where

            try:
                one()
            except Unsatisfiable:  # no invalid request exists for an operation without parameters or body
                assert mode == GenerationMode.NEGATIVE
    return statuses


def test_generated_requests_never_get_a_5xx(service: LocalService) -> None:
    statuses = fuzz(service.url, FUZZ_EXAMPLES)
    print(f"schemathesis: {sum(statuses.values())} generated requests; statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) > 0 and not any(code >= 500 for code in statuses)
