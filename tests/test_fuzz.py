"""schemathesis against the live app's /openapi.json: no generated request gets a 5xx; errors have our shape.

Every generated request runs for real (compactions on the CPU model), so each is kept cheap: output
budgets are capped at a few tokens and no deadline is sent (a 504 the client asked for is not a
server fault). `FUZZ_EXAMPLES` bounds the examples per operation; the count is printed.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from serving.local import LocalService

pytestmark = [pytest.mark.ray, pytest.mark.engine]

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
OPERATIONS = r"^/(v1/compact|healthz|v1/models|v1/chat/completions|v1/completions)$"
# Output-length fields of the operations, capped so a generated request costs a few decode steps.
CAPS = {"max_chunk_summary_tokens": 8, "max_tokens": 4, "max_completion_tokens": 4, "n": 1, "best_of": 1}
STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module")
def live_schema(service: LocalService) -> Any:
    return schemathesis.openapi.from_url(f"{service.url}/openapi.json").include(path_regex=OPERATIONS)


schema = schemathesis.pytest.from_fixture("live_schema")


def cheapen(body: Any) -> None:
    if not isinstance(body, dict):
        return
    body.pop("timeout_s", None)
    for field, cap in CAPS.items():
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            body[field] = max(0, min(body[field], cap))


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_generated_requests_never_get_a_5xx(case: Any, service: LocalService) -> None:
    cheapen(case.body)
    response = case.call(base_url=service.url, timeout=600)
    STATUSES[response.status_code] += 1
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["message"], response.text[:500]


def test_fuzzing_report() -> None:
    """Runs after the generated tests (file order): how many requests, and by status."""
    print(f"schemathesis: {sum(STATUSES.values())} generated requests; statuses {dict(sorted(STATUSES.items()))}")
    assert sum(STATUSES.values()) > 0 and not any(code >= 500 for code in STATUSES)
