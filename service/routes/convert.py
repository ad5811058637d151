"""Index results -> response models."""

from __future__ import annotations

from typing import TypedDict

from index import Explanation, FragmentMatch, ImageHit, ImageRecord, RegionHit, SentenceHit
from service.schemas import (
    ExplainResponse,
    FragmentMatchOut,
    ImageOut,
    ImageResult,
    PairOut,
    RegionResult,
    SentenceResult,
)
from service.settings import Settings


def image_url(image_id: int) -> str:
    return f"/images/{image_id}"


def thumbnail_url(image_id: int, size: int = 256) -> str:
    return f"/images/{image_id}/thumbnail?size={size}"


class Paging(TypedDict):
    offset: int
    next_offset: int | None
    considered: int


def paging(offset: int, k: int, returned: int, considered: int, settings: Settings) -> Paging:
    """A page's offset, the next page's offset (None on the last page) and the items considered."""
    more = returned == k and offset + k < considered and offset + k < settings.max_rank
    return {"offset": offset, "next_offset": offset + k if more else None, "considered": considered}


def _box(box: list[float]) -> list[float]:
    return [round(float(v), 2) for v in box]


def match_out(m: FragmentMatch) -> FragmentMatchOut:
    return FragmentMatchOut(triplet=m.triplet, relation=m.relation, words=list(m.words), box=_box(m.box),
                            fragment=int(m.fragment), score=float(m.score))


def image_result(hit: ImageHit) -> ImageResult:
    return ImageResult(id=hit.image_id, name=hit.name, url=image_url(hit.image_id),
                       thumbnail=thumbnail_url(hit.image_id), width=hit.width,
                       height=hit.height, score=float(hit.score), alignment=[match_out(m) for m in hit.alignment])


def sentence_result(hit: SentenceHit) -> SentenceResult:
    return SentenceResult(id=hit.sentence_id, text=hit.text, score=float(hit.score),
                          alignment=[match_out(m) for m in hit.alignment])


def region_result(hit: RegionHit) -> RegionResult:
    return RegionResult(image_id=hit.image_id, name=hit.name, url=image_url(hit.image_id), box=_box(hit.box),
                        fragment=int(hit.fragment), score=float(hit.score))


def image_out(rec: ImageRecord) -> ImageOut:
    return ImageOut(id=rec.image_id, name=rec.name, url=image_url(rec.image_id), width=rec.width, height=rec.height)


def explain_out(e: Explanation, sentence: str, took_ms: float) -> ExplainResponse:
    return ExplainResponse(
        image_id=e.image_id, name=e.name, url=image_url(e.image_id), thumbnail=thumbnail_url(e.image_id),
        width=e.width, height=e.height, sentence=sentence, score=e.score, rank=e.rank, images=e.images,
        scope=e.scope, recalled=e.recalled,
        image_fragments=e.image_fragments, sentence_fragments=e.sentence_fragments,
        alignment=[match_out(m) for m in e.alignment],
        pairs=[PairOut(triplet=p.triplet, relation=p.relation, words=list(p.words), fragment=p.fragment,
                       box=_box(p.box), score=p.score, cleared=p.cleared, contribution=p.contribution)
               for p in e.pairs],
        took_ms=took_ms)
