"""Index results -> response models."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TypedDict, TypeVar

from index import Explanation, FragmentMatch, ImageHit, ImageRecord, RegionHit, SentenceHit
from index.places import Near, Place, PlaceFilter
from model.calibration import Relevance
from model.text import Triplet
from service.errors import ApiError
from service.schemas import (
    ExplainResponse,
    FragmentMatchOut,
    ImageOut,
    ImageResult,
    PairOut,
    RegionResult,
    SearchImagesRequest,
    SentenceResult,
    clock_seconds,
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


H = TypeVar("H", ImageHit, SentenceHit)


def check_min_relevance(value: float | None, relevance: Relevance | None) -> float | None:
    """A cut-off needs the model's relevance scale: without one (an older checkpoint) it is a 422."""
    if value is not None and relevance is None:
        raise ApiError(422, "no_relevance_scale", "the served model has no relevance scale, so min_relevance "
                       "cannot be applied: it was trained without a validation part (--selection last), or is "
                       "uncalibrated, or older than the scale. The released model has one; for a model of your own, "
                       "train it with --selection val or refit the scale with python -m training.calibrate "
                       "--relevance-only")
    return value


class CutOff(TypedDict):
    min_relevance: float | None
    reason: str | None


def cut_off(hits: list[H], relevance: Relevance | None, min_relevance: float | None, what: str
            ) -> tuple[list[H], CutOff]:
    """The hits whose relevance reaches `min_relevance` (the ranking is by score and the scale is
    increasing in it, so this keeps a prefix), and why the list is empty when the cut-off empties it.
    Compared is the relevance a result shows, rounded as `relevance_of` rounds it."""
    if min_relevance is None or relevance is None:
        return hits, {"min_relevance": None, "reason": None}
    # the relevance each result shows (rounded): a shown value given back as the cut-off keeps its results
    kept = [h for h in hits if (relevance_of(h.score, relevance) or 0.0) >= min_relevance]
    reason = None
    if hits and not kept:
        best = relevance.of(max(h.score for h in hits))
        reason = f"no good match: no {what} reaches relevance {min_relevance:.2f} (the best has {best:.2f})"
    return kept, {"min_relevance": min_relevance, "reason": reason}


def by_date_taken(hits: list[ImageHit]) -> list[ImageHit]:
    """Newest photo first (EXIF date taken); photos without a date after them; ties by score, then id."""
    def key(h: ImageHit) -> tuple[bool, float, float, int]:
        taken = None if h.place is None else h.place.taken
        return taken is None, -(taken or 0.0), -h.score, h.image_id

    return sorted(hits, key=key)


def relevance_of(score: float, relevance: Relevance | None) -> float | None:
    return None if relevance is None else round(relevance.of(score), 4)


def _box(box: list[float]) -> list[float]:
    return [round(float(v), 2) for v in box]


def match_out(m: FragmentMatch) -> FragmentMatchOut:
    return FragmentMatchOut(triplet=m.triplet, phrase=phrase_of(m.relation, m.words), relation=m.relation,
                            words=list(m.words), box=_box(m.box), fragment=int(m.fragment), score=float(m.score),
                            label=m.label)


def phrase_of(relation: str, words: tuple[str, str]) -> str:
    return Triplet(relation, *words).phrase()


def image_result(hit: ImageHit, relevance: Relevance | None = None) -> ImageResult:
    pl = hit.place or Place()
    taken = None if pl.taken is None else datetime.fromtimestamp(pl.taken, UTC).replace(tzinfo=None).isoformat()
    return ImageResult(id=hit.image_id, name=hit.name, path=hit.file, url=image_url(hit.image_id),
                       thumbnail=thumbnail_url(hit.image_id), width=hit.width,
                       height=hit.height, score=float(hit.score), relevance=relevance_of(hit.score, relevance),
                       taken=taken, lat=pl.lat, lon=pl.lon, alignment=[match_out(m) for m in hit.alignment])


def place_filter(body: SearchImagesRequest) -> PlaceFilter:
    """The request's date and place filters (already validated by the request model)."""
    near = None if body.near is None else Near(body.near.lat, body.near.lon, body.near.km)
    return PlaceFilter(None if body.taken_after is None else clock_seconds(body.taken_after),
                       None if body.taken_before is None else clock_seconds(body.taken_before), near)


def sentence_result(hit: SentenceHit, relevance: Relevance | None = None) -> SentenceResult:
    return SentenceResult(id=hit.sentence_id, text=hit.text, score=float(hit.score),
                          relevance=relevance_of(hit.score, relevance), alignment=[match_out(m) for m in hit.alignment])


def region_result(hit: RegionHit) -> RegionResult:
    return RegionResult(image_id=hit.image_id, name=hit.name, path=hit.file, url=image_url(hit.image_id),
                        thumbnail=thumbnail_url(hit.image_id), width=hit.width, height=hit.height, box=_box(hit.box),
                        fragment=int(hit.fragment), score=float(hit.score), label=hit.label)


def image_out(rec: ImageRecord) -> ImageOut:
    return ImageOut(id=rec.image_id, name=rec.name, path=rec.file, url=image_url(rec.image_id), width=rec.width,
                    height=rec.height)


def explain_out(e: Explanation, sentence: str, took_ms: float, relevance: Relevance | None = None) -> ExplainResponse:
    return ExplainResponse(
        image_id=e.image_id, name=e.name, url=image_url(e.image_id), thumbnail=thumbnail_url(e.image_id),
        width=e.width, height=e.height, sentence=sentence, score=e.score,
        relevance=relevance_of(e.score, relevance), rank=e.rank, images=e.images,
        scope=e.scope, recalled=e.recalled,
        image_fragments=e.image_fragments, sentence_fragments=e.sentence_fragments,
        alignment=[match_out(m) for m in e.alignment],
        pairs=[PairOut(triplet=p.triplet, phrase=phrase_of(p.relation, p.words), relation=p.relation,
                       words=list(p.words), fragment=p.fragment, box=_box(p.box), score=p.score, cleared=p.cleared,
                       contribution=p.contribution, label=p.label)
               for p in e.pairs],
        took_ms=took_ms)
