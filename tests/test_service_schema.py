"""Property-based requests generated from the OpenAPI schema (schemathesis, positive and negative
data): no server error, and every answer is one the schema lists (status code, content type, body).

The schema is loaded from the app with `schemathesis.openapi.from_asgi`; each operation's cases
come from its Hypothesis strategy (the app needs session fixtures, so the schema is built inside
the test rather than at import time). The stateful test follows the schema's links (an upload's
id into GET and DELETE /images/{image_id}, among searches) through sequences of calls.

A longer run (more examples per operation, more stateful sequences) is marked slow:

    FRAGSEARCH_FUZZ_EXAMPLES=400 FRAGSEARCH_FUZZ_REPORT=docs/results/fuzz-long.json \
        ./run python -m pytest tests/test_service_schema.py -m slow
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, checks

from fragsearch.service.app import create_app

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

MAX_EXAMPLES = 25
STATEFUL_EXAMPLES = 15
LONG_EXAMPLES = int(os.environ.get("FRAGSEARCH_FUZZ_EXAMPLES", "300"))
OPERATIONS = [
    ("POST", "/search/images"),
    ("POST", "/search/fragments"),
    ("POST", "/explain"),
    ("POST", "/search/similar"),
    ("POST", "/annotate"),
    ("GET", "/images/{image_id}"),
    ("GET", "/images/{image_id}/thumbnail"),
    ("GET", "/images/{image_id}/duplicates"),
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


def fuzz_operation(api_schema: schemathesis.BaseSchema, key: str, method: str, path: str,
                   examples: int) -> Counter[int]:
    """Generated cases of one operation, each sent (with and without the write key where it matters)
    and checked; returns the status codes answered."""
    statuses: Counter[int] = Counter()
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
            statuses[response.status_code] += 1
            case.validate_response(response, checks=CHECKS)

    run()
    return statuses


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_server_error_and_only_documented_answers(api_schema: schemathesis.BaseSchema, service_env: ServiceEnv,
                                                     method: str, path: str) -> None:
    fuzz_operation(api_schema, service_env.api_key, method, path, MAX_EXAMPLES)


# Sentences the shapes model can match, mixed with made-up, empty and odd tokens: the generated cases
# above almost never hold a known content word, so without these the searches would only ever be refused.
WORDS = ("a", "the", "red", "blue", "green", "yellow", "circle", "square", "triangle", "beside", "above", "and")
SENTENCES = st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=6)), min_size=0, max_size=14).map(" ".join)


def fuzz_searches(api_schema: schemathesis.BaseSchema, examples: int) -> Counter[int]:
    """Searches with sentences and phrases of known and unknown words and any k; returns the statuses."""
    statuses: Counter[int] = Counter()
    images = api_schema["/search/images"]["POST"]
    fragments = api_schema["/search/fragments"]["POST"]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(sentence=SENTENCES, k=st.one_of(st.integers(1, 10), st.integers(-3, 300)))  # the tests' k limit: 40
    def run(sentence: str, k: int) -> None:
        for case in (images.Case(body={"sentence": sentence, "k": k}, media_type="application/json"),
                     fragments.Case(body={"phrase": sentence, "k": k}, media_type="application/json")):
            response = case.call()
            statuses[response.status_code] += 1
            case.validate_response(response, checks=CHECKS)

    run()
    return statuses


def test_searches_of_known_and_unknown_words(api_schema: schemathesis.BaseSchema) -> None:
    statuses = fuzz_searches(api_schema, MAX_EXAMPLES * 2)
    assert set(statuses) <= {200, 422}, statuses
    assert statuses[200] > 0 and statuses[422] > 0, statuses


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
    assert {v["operationId"] for v in links.values()} == {"get_image", "get_thumbnail", "delete_image"}
    assert run_stateful(api_schema, service_env.api_key, STATEFUL_EXAMPLES) >= 2 * STATEFUL_EXAMPLES


@pytest.mark.slow
def test_long_fuzz(api_schema: schemathesis.BaseSchema, service_env: ServiceEnv) -> None:
    """The same checks with LONG_EXAMPLES examples per operation and as many stateful sequences; with
    FRAGSEARCH_FUZZ_REPORT set, what was sent and answered is written as JSON beside that path, one file
    per backend (<name>-faiss.json, <name>-milvus.json)."""
    t0 = time.perf_counter()
    answered = {f"{method} {path}": fuzz_operation(api_schema, service_env.api_key, method, path, LONG_EXAMPLES)
                for method, path in OPERATIONS}
    answered["searches of known and unknown words"] = fuzz_searches(api_schema, LONG_EXAMPLES)
    stateful_calls = run_stateful(api_schema, service_env.api_key, LONG_EXAMPLES)
    assert stateful_calls >= 2 * LONG_EXAMPLES
    report = os.environ.get("FRAGSEARCH_FUZZ_REPORT")
    if report:
        statuses = sum(answered.values(), Counter())
        backend = service_env.settings.index_backend
        written = Path(report).with_name(f"{Path(report).stem}-{backend}{Path(report).suffix}")
        written.write_text(json.dumps({
            "backend": backend,
            "examples_per_operation": LONG_EXAMPLES,
            "calls": sum(statuses.values()) + stateful_calls,
            "stateful_calls": stateful_calls,
            "server_errors": sum(n for code, n in statuses.items() if code >= 500),
            "statuses": {str(code): n for code, n in sorted(statuses.items())},
            "per_operation": {op: {str(code): n for code, n in sorted(c.items())} for op, c in answered.items()},
            "seconds": round(time.perf_counter() - t0, 1),
            "checks": [c.__name__ for c in CHECKS],
            "command": f"FRAGSEARCH_FUZZ_EXAMPLES={LONG_EXAMPLES} FRAGSEARCH_FUZZ_REPORT={report} "
                       "./run python -m pytest -m slow tests/test_service_schema.py",
        }, indent=2) + "\n")
