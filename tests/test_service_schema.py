"""Property-based requests generated from the OpenAPI schema (schemathesis, positive and negative
data): no server error, and every answer is one the schema lists (status code, content type, body).

The schema is loaded from the app with `schemathesis.openapi.from_asgi`; each operation's cases
come from its Hypothesis strategy (the app needs session fixtures, so the schema is built inside
the test rather than at import time).
"""

from __future__ import annotations

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


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_server_error_and_only_documented_answers(api_schema: schemathesis.BaseSchema, service_env: ServiceEnv,
                                                     method: str, path: str) -> None:
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    key_variants: tuple[dict[str, str], ...] = ({},)
    if method in ("POST", "DELETE") and path.startswith("/images"):
        key_variants = ({}, {"X-API-Key": service_env.api_key})

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        for headers in key_variants:
            response = case.call(headers=headers)
            case.validate_response(response, checks=CHECKS)

    run()
