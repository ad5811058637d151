"""POST /search/images, POST /search/fragments, POST /search/similar, POST /explain, POST /annotate."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, File, Form, UploadFile

from fragsearch.index import ImageHit
from fragsearch.index.ids import MAX_ID
from fragsearch.index.similar import Similar
from fragsearch.service.deps import BoundsDep, EngineDep, GatesDep, SettingsDep
from fragsearch.service.errors import ApiError, responses
from fragsearch.service.routes.convert import (
    by_date_taken,
    check_min_relevance,
    explain_out,
    image_result,
    paging,
    place_filter,
    region_result,
    relevances,
    sentence_result,
    shown,
)
from fragsearch.service.routes.uploads import read_upload
from fragsearch.service.schemas import (
    DEFAULT_K,
    AnnotateResponse,
    ExplainRequest,
    ExplainResponse,
    ImageResult,
    SearchFragmentsRequest,
    SearchFragmentsResponse,
    SearchImagesRequest,
    SearchImagesResponse,
    SimilarResponse,
)

OffsetForm = Annotated[int, Form(ge=0, description="ranks skipped: the page starts at rank offset + 1")]
MinRelevanceForm = Annotated[float | None, Form(ge=0.0, le=1.0, description=(
    "leave out results whose relevance is below this (0 to 1); none left -> an empty list and a `reason`"))]


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


router = APIRouter(tags=["search"])


@router.post("/search/images", response_model=SearchImagesResponse, responses=responses(413, 422, 503, 504))
async def search_images(body: SearchImagesRequest, engine: EngineDep, s: SettingsDep,
                        gates: GatesDep, bounds: BoundsDep) -> SearchImagesResponse:
    """Images ranked by S_kl for a sentence, each with its fragment alignment."""
    t0 = time.perf_counter()
    k, offset = bounds.page(body.k, body.offset)
    sentence = bounds.text(body.sentence, "sentence")
    min_relevance = check_min_relevance(body.min_relevance, engine.bundle.relevance)
    where = place_filter(body)
    if body.sort == "taken":  # every result above the cut-off (to the deepest rank), then by date
        page = await gates.search.run(engine.search_images, sentence, s.max_rank, 0, where)
        view = shown(engine.bundle, "images", page, min_relevance)
        cut = view.cut
        hits = by_date_taken(view.hits)[offset : offset + k]
        weaker = [] if hits or offset else view.weaker[:k]
        pages = paging(offset, k, len(hits), len(view.hits), s)
    else:
        page = await gates.search.run(engine.search_images, sentence, k, offset, where)
        view = shown(engine.bundle, "images", page, min_relevance)
        hits, weaker, cut = view.hits, view.weaker, view.cut
        pages = paging(offset, k, len(hits) + len(weaker), page.considered, s)
    if where and page.considered == 0:
        cut["reason"] = "no photo passes the date and place filters (photos without an EXIF date or " \
                        "position are left out by a filter on it)"
    pages["considered"] = page.considered
    def out(results: list[ImageHit]) -> list[ImageResult]:
        return [image_result(h, view.of(h)) for h in results]

    return SearchImagesResponse(sentence=sentence, results=out(hits), weaker=out(weaker), **cut, **pages,
                                took_ms=_ms(t0))


@router.post("/search/fragments", response_model=SearchFragmentsResponse, responses=responses(413, 422, 503, 504))
async def search_fragments(body: SearchFragmentsRequest, engine: EngineDep,
                           s: SettingsDep, gates: GatesDep, bounds: BoundsDep) -> SearchFragmentsResponse:
    """Image regions that best match a phrase or one dependency triplet."""
    t0 = time.perf_counter()
    k, offset = bounds.page(body.k, body.offset)
    if body.triplet is not None:
        t = body.triplet
        query = f"{t.relation}({t.w1}, {t.w2})"
        bounds.text(f"{t.w1} {t.w2}", "triplet")
        page = await gates.search.run(engine.search_triplet, t.relation, t.w1, t.w2, k, offset)
    else:
        assert body.phrase is not None
        query = bounds.text(body.phrase, "phrase")
        page = await gates.search.run(engine.search_fragments, query, k, offset)
    return SearchFragmentsResponse(query=query, results=[region_result(h) for h in page.hits],
                                   **paging(offset, k, len(page.hits), page.considered, s), took_ms=_ms(t0))


@router.post("/explain", response_model=ExplainResponse, responses=responses(404, 413, 422, 503, 504))
async def explain(body: ExplainRequest, engine: EngineDep, gates: GatesDep, bounds: BoundsDep) -> ExplainResponse:
    """Why (not) this image: its S_kl for the sentence, the rank the exact score gives it among all
    indexed images, and every fragment pair's score, whether it clears the threshold and its share."""
    t0 = time.perf_counter()
    sentence = bounds.text(body.sentence, "sentence")
    found = await gates.search.run(engine.explain, body.image_id, sentence)
    if found is None:
        raise ApiError(404, "not_found", f"no image with id {body.image_id}")
    return explain_out(found, sentence, _ms(t0), engine.relevance("images", found.best, found.collection))


@router.post("/search/similar", response_model=SimilarResponse,
             responses=responses(404, 408, 413, 415, 422, 503, 504))
async def search_similar(
    engine: EngineDep, s: SettingsDep, gates: GatesDep, bounds: BoundsDep,
    file: Annotated[UploadFile | None, File(description="an image (JPEG, PNG, ...); or give image_id")] = None,
    image_id: Annotated[int | None, Form(ge=0, le=MAX_ID, description="an indexed image's id")] = None,
    k: Annotated[int, Form(ge=1, description="number of images")] = DEFAULT_K,
    offset: OffsetForm = 0,
) -> SimilarResponse:
    """More like this: images ranked for an indexed image (`image_id`, itself left out) or an upload
    (`file`) by the cosine of their mean embedded fragments (`score`), each result explained by
    the sentences that describe the query best (see `described_by`): which of their triplets it
    matches, and where."""
    t0 = time.perf_counter()
    k, offset = bounds.page(k, offset)
    if (file is None) == (image_id is None):
        raise ApiError(422, "one_query", "give exactly one of 'file' (an upload) or 'image_id'")
    result: Similar
    if image_id is not None:
        found = await gates.search.run(engine.similar_to_image, image_id, k, offset)
        if found is None:
            raise ApiError(404, "not_found", f"no image with id {image_id}")
        (width, height), result = found
    else:
        assert file is not None
        data = await read_upload(file)
        decoded, result = await gates.heavy.run(engine.similar_to_upload, data, k, offset)
        width, height = decoded.width, decoded.height
    rel = engine.relevance("sentences", result.described_best, result.described_collection)
    return SimilarResponse(image_id=image_id, width=width, height=height,
                           described_by=[sentence_result(h, v) for h, v in
                                         zip(result.described_by, relevances(result.described_by, rel), strict=True)],
                           results=[image_result(h) for h in result.hits],
                           **paging(offset, k, len(result.hits), result.considered, s), took_ms=_ms(t0))


@router.post("/annotate", response_model=AnnotateResponse,
             responses=responses(408, 409, 413, 415, 422, 503, 504))
async def annotate(file: Annotated[UploadFile, File(description="an image (JPEG, PNG, ...)")],
                   engine: EngineDep, s: SettingsDep, gates: GatesDep, bounds: BoundsDep,
                   k: Annotated[int, Form(ge=1, description="number of sentences")] = 5,
                   offset: OffsetForm = 0,
                   min_relevance: MinRelevanceForm = None,
                   ) -> AnnotateResponse:
    """Sentences of the collection ranked by S_kl for an uploaded image, with their alignments
    to the upload's regions (boxes in the upload's pixels)."""
    t0 = time.perf_counter()
    k, offset = bounds.page(k, offset)
    min_relevance = check_min_relevance(min_relevance, engine.bundle.relevance)
    data = await read_upload(file)
    decoded, page = await gates.heavy.run(engine.annotate, data, k, offset)
    view = shown(engine.bundle, "sentences", page, min_relevance)
    return AnnotateResponse(width=decoded.width, height=decoded.height,
                            results=[sentence_result(h, view.of(h)) for h in view.hits],
                            weaker=[sentence_result(h, view.of(h)) for h in view.weaker], **view.cut,
                            **paging(offset, k, len(view.hits) + len(view.weaker), page.considered, s),
                            took_ms=_ms(t0))
