"""Queries with nothing to match: only punctuation, only emoji, only made-up or function words.

Such a query is refused with 422 `no_fragments` by every route that takes text
(/search/images, /search/fragments with a phrase or a triplet), whatever the model's word
vectors: the rule (at least one content word of the training vocabulary) lives in the one text
pipeline every route and model encodes queries with.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
from fastapi.testclient import TestClient

from fragsearch.model.fragments import NoFragmentsError, TextPipeline
from fragsearch.model.text import RelationVocab

if TYPE_CHECKING:
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

NOTHING_TO_MATCH = ["!!!", "🐶🐱", "xqzv blorp", "... ?? !!", "the of and a", "a xqzv", "42 1000"]


@pytest.mark.parametrize("query", NOTHING_TO_MATCH)
def test_every_text_route_refuses_a_query_with_nothing_to_match(client: TestClient, query: str) -> None:
    answers = [
        client.post("/search/images", json={"sentence": query, "k": 5}),
        client.post("/search/fragments", json={"phrase": query, "k": 5}),
    ]
    words = query.split() + ["xqzv"]
    answers.append(client.post("/search/fragments", json={"triplet": {"relation": "amod", "w1": words[0][:60],
                                                                      "w2": words[1][:60]}}))
    for r in answers:
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "no_fragments"
        assert "nothing to match" in error["message"]


def test_a_query_with_one_known_content_word_is_answered(client: TestClient) -> None:
    for body in ({"sentence": "xqzv blorp red"}, {"sentence": "a circle !!!"}):
        r = client.post("/search/images", json={**body, "k": 3})
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == 3
    r = client.post("/search/fragments", json={"triplet": {"relation": "amod", "w1": "circle", "w2": "red"}})
    assert r.status_code == 200, r.text


def test_contextual_word_vectors_and_a_sentence_fragment_refuse_the_same_queries(service_env: ServiceEnv) -> None:
    """With contextual vectors every token has a vector and the whole-sentence fragment exists for any
    text, so fragments alone never run out; the content-word rule refuses the same queries."""
    static = service_env.shapes.bundle.text
    cfg = dataclasses.replace(static.cfg, word_vectors="contextual", sentence_fragment=True)
    relations = RelationVocab(TextPipeline.relation_names(cfg, static.relations.kept), static.relations.counts)
    contextual = TextPipeline(cfg, relations, static.words, static.parser)
    for query in NOTHING_TO_MATCH:
        with pytest.raises(NoFragmentsError, match="nothing to match"):
            contextual.encode([query], strict=True)
        assert len(contextual.encode([query], strict=False).triplets[0]) >= 1, "fragments exist all the same"
    enc = contextual.encode(["a red circle beside a blue square"], strict=True)
    assert len(enc.triplets[0]) > 1
