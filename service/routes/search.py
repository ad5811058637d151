"""POST /search/images, POST /search/fragments, POST /explain, POST /annotate."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, File, Form, UploadFile

from service.deps import EngineDep, GatesDep, SettingsDep
from service.errors import ApiError, responses
from service.routes.convert import check_k, check_text, explain_out, image_result, region_result, sentence_result
from service.routes.uploads import read_upload
from service.schemas import (
    AnnotateResponse,
    ExplainRequest,
    ExplainResponse,
    SearchFragmentsRequest,
    SearchFragmentsResponse,
    SearchImagesRequest,
    SearchImagesResponse,
)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


def build_router() -> APIRouter:
    router = APIRouter(tags=["search"])

    @router.post("/search/images", response_model=SearchImagesResponse, responses=responses(413, 422, 503, 504))
    async def search_images(body: SearchImagesRequest, engine: EngineDep, s: SettingsDep,
                            gates: GatesDep) -> SearchImagesResponse:
        """Images ranked by S_kl for a sentence, each with its fragment alignment."""
        t0 = time.perf_counter()
        k = check_k(body.k, s)
        sentence = check_text(body.sentence, s, "sentence")
        hits = await gates.search.run(engine.search_images, sentence, k)
        return SearchImagesResponse(sentence=sentence, results=[image_result(h) for h in hits], took_ms=_ms(t0))

    @router.post("/search/fragments", response_model=SearchFragmentsResponse, responses=responses(413, 422, 503, 504))
    async def search_fragments(body: SearchFragmentsRequest, engine: EngineDep,
                               s: SettingsDep, gates: GatesDep) -> SearchFragmentsResponse:
        """Image regions that best match a phrase or one dependency triplet."""
        t0 = time.perf_counter()
        k = check_k(body.k, s)
        if body.triplet is not None:
            t = body.triplet
            query = f"{t.relation}({t.w1}, {t.w2})"
            check_text(f"{t.w1} {t.w2}", s, "triplet")
            hits = await gates.search.run(engine.search_triplet, t.relation, t.w1, t.w2, k)
        else:
            assert body.phrase is not None
            query = check_text(body.phrase, s, "phrase")
            hits = await gates.search.run(engine.search_fragments, query, k)
        return SearchFragmentsResponse(query=query, results=[region_result(h) for h in hits], took_ms=_ms(t0))

    @router.post("/explain", response_model=ExplainResponse, responses=responses(404, 413, 422, 503, 504))
    async def explain(body: ExplainRequest, engine: EngineDep, s: SettingsDep, gates: GatesDep) -> ExplainResponse:
        """Why (not) this image: its S_kl for the sentence, the rank the exact score gives it among all
        indexed images, and every fragment pair's score, whether it clears the threshold and its share."""
        t0 = time.perf_counter()
        sentence = check_text(body.sentence, s, "sentence")
        found = await gates.search.run(engine.explain, body.image_id, sentence)
        if found is None:
            raise ApiError(404, "not_found", f"no image with id {body.image_id}")
        return explain_out(found, sentence, _ms(t0))

    @router.post("/annotate", response_model=AnnotateResponse, responses=responses(408, 413, 415, 422, 503, 504))
    async def annotate(file: Annotated[UploadFile, File(description="an image (JPEG, PNG, ...)")],
                       engine: EngineDep, s: SettingsDep, gates: GatesDep,
                       k: Annotated[int, Form(ge=1, description="number of sentences")] = 5) -> AnnotateResponse:
        """Sentences of the collection ranked by S_kl for an uploaded image, with their alignments
        to the upload's regions (boxes in the upload's pixels)."""
        t0 = time.perf_counter()
        k = check_k(k, s)
        data = await read_upload(file, s.max_upload_bytes)
        decoded, hits = await gates.heavy.run(engine.annotate, data, k)
        return AnnotateResponse(width=decoded.width, height=decoded.height,
                                results=[sentence_result(h) for h in hits], took_ms=_ms(t0))

    return router
