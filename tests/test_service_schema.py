"""Property-based requests generated from the OpenAPI schema (schemathesis, positive and negative
data): no server error, and every answer is one the schema lists (status code, content type, body).

The schema is loaded from the app with `schemathesis.openapi.from_asgi`; each operation's cases
come from its Hypothesis strategy (the app needs session fixtures, so the schema is built inside
the test rather than at import time). The stateful test follows the schema's links (an upload's
id into GET and DELETE /images/{image_id}, among searches) through sequences of calls.

A longer run (more examples per operation, more stateful sequences) is marked slow:

    FRAGSEARCH_FUZZ_EXAMPLES=400 ./run python -m pytest tests/test_service_schema.py -m slow
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from service.app import create_app

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

MAX_EXAMPLES = 25
STATEFUL_EXAMPLES = 15
LONG_EXAMPLES = int(os.environ.get("FRAGSEARCH_FUZZ_EXAMPLES", "300"))
OPERATIONS = [
    ("POST", "/search/images"),
    ("POST", "/search/fragments"),
    ("POST", "/annotate"),
    ("GET", "/images/{image_id}"),
    ("POST", "/images"),
    ("DELETE", "/images/{image_id}"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
]
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def api_schema(service_env: ServiceEnv, tmp_path_factory: pytest.TempPathFactory) -> schemathesis.BaseSchema:
    """The schema of an app over a private copy of the indexes (generated writes may delete images)."""
    tmp: Path = tmp_path_factory.mktemp("schema")
    app_settings, engine = service_env.writable(tmp)
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(app_settings, engine=engine))


def test_the_schema_lists_every_operation(api_schema: schemathesis.BaseSchema) -> None:
    found = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


def fuzz_operation(api_schema: schemathesis.BaseSchema, key: str, method: str, path: str, examples: int) -> None:
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    key_variants: tuple[dict[str, str], ...] = ({},)
    if method in ("POST", "DELETE") and path.startswith("/images"):
        key_variants = ({}, {"X-API-Key": key})

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        for headers in key_variants:
            response = case.call(headers=headers)
            case.validate_response(response, checks=CHECKS)

    run()


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_server_error_and_only_documented_answers(api_schema: schemathesis.BaseSchema, service_env: ServiceEnv,
                                                     method: str, path: str) -> None:
    fuzz_operation(api_schema, service_env.api_key, method, path, MAX_EXAMPLES)


def run_stateful(api_schema: schemathesis.BaseSchema, key: str, examples: int) -> int:
    """Sequences of linked calls (with the write key); returns how many calls were made."""
    calls = [0]

    class Workflow(api_schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, object]:
            return {"headers": {"X-API-Key": key}}

        def after_call(self, response: object, case: schemathesis.Case) -> None:
            calls[0] += 1

        def validate_response(self, response: object, case: schemathesis.Case, additional_checks: object = None,
                              **kwargs: object) -> None:
            case.validate_response(response, checks=CHECKS)

    Workflow.run(settings=settings(max_examples=examples, stateful_step_count=6, deadline=None, derandomize=True,
                                   database=None, suppress_health_check=list(HealthCheck)))
    return calls[0]


def test_stateful_sequences_follow_the_links(api_schema: schemathesis.BaseSchema, service_env: ServiceEnv) -> None:
    links = api_schema.raw_schema["paths"]["/images"]["post"]["responses"]["201"]["links"]
    assert {v["operationId"] for v in links.values()} == {"get_image", "delete_image"}
    assert run_stateful(api_schema, service_env.api_key, STATEFUL_EXAMPLES) >= 2 * STATEFUL_EXAMPLES


@pytest.mark.slow
def test_long_fuzz(api_schema: schemathesis.BaseSchema, service_env: ServiceEnv) -> None:
    """The same checks with LONG_EXAMPLES examples per operation and as many stateful sequences."""
    for method, path in OPERATIONS:
        fuzz_operation(api_schema, service_env.api_key, method, path, LONG_EXAMPLES)
    assert run_stateful(api_schema, service_env.api_key, LONG_EXAMPLES) >= 2 * LONG_EXAMPLES
