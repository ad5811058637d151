"""Index results -> response models."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Generic, TypedDict, TypeVar

import numpy as np

from fragsearch.index import Explanation, FragmentMatch, ImageHit, ImageRecord, Page, RegionHit, SentenceHit
from fragsearch.index.places import Near, Place, PlaceFilter
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Relevance
from fragsearch.model.evidence import FOUND, Found
from fragsearch.model.text import Triplet
from fragsearch.service.engine import Side, relevance_at
from fragsearch.service.errors import ApiError
from fragsearch.service.schemas import (
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
from fragsearch.settings import Settings


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
                       "train it with --selection val or refit the scale with python -m fragsearch.training.calibrate "
                       "--relevance-only")
    return value


class CutOff(TypedDict):
    min_relevance: float | None
    reason: str | None


def shown_relevance(score: float, relevance: Relevance, found: Found | None) -> float:
    """The relevance a result shows (rounded): a shown value given back as the cut-off keeps its result."""
    return _shown(np.asarray([score], dtype=np.float64), relevance, [found])[0]


def relevances(hits: Sequence[ImageHit] | Sequence[SentenceHit], relevance: Relevance | None) -> list[float | None]:
    """The relevance each of a page's results shows (`shown_relevance`), read for the page in one call (None:
    the model has no relevance scale)."""
    if relevance is None:
        return [None] * len(hits)
    return list(_shown(np.asarray([h.score for h in hits], dtype=np.float64), relevance,
                       [h.found for h in hits]))


def _shown(scores: np.ndarray, relevance: Relevance, founds: Sequence[Found | None]) -> list[float]:
    if not len(scores):
        return []
    terms = (None if all(f is None for f in founds) else
             np.stack([np.zeros(2) if f is None else f.terms() for f in founds]))
    return [round(float(v), 4) for v in np.asarray(relevance(scores, terms)).reshape(-1)]


def missing_everywhere(hits: Sequence[ImageHit] | Sequence[SentenceHit]) -> list[str]:
    """The things the query names that none of `hits` holds (phrase evidence), least likely first."""
    founds = [h.found for h in hits]
    if not founds or any(f is None or not f.things for f in founds):
        return []
    first = founds[0]
    assert first is not None
    return [w for w in first.missing if all(f is not None and w in f.missing for f in founds)]


def cut_off(hits: list[H], values: Sequence[float | None], min_relevance: float | None, what: str,
            items: int | None = None) -> tuple[list[H], list[H], CutOff]:
    """(the hits whose relevance reaches `min_relevance`, the hits under it, the cut-off and why the first list
    is empty when it is), both lists in ranking order; `values`: the relevance each hit shows (`relevances`;
    None: the model has no scale). The relevance reads each result's phrase evidence, so a result under the
    cut-off may rank above one that reaches it. `items`: the collection's size, named in the reason (the things
    no result holds: "nothing in the 60 images matches 'giraffe'")."""
    if min_relevance is None or any(v is None for v in values):
        return hits, [], {"min_relevance": None, "reason": None}
    shown = [float(v) for v in values if v is not None]
    kept = [h for h, r in zip(hits, shown, strict=True) if r >= min_relevance]
    weaker = [h for h, r in zip(hits, shown, strict=True) if r < min_relevance]
    reason = None
    if hits and not kept:
        lacking = missing_everywhere([h for h in hits if isinstance(h, ImageHit | SentenceHit)])
        where = f"the {items} {what}s" if items else f"the {len(hits)} best {what}s"
        if lacking:
            names = " or ".join(f"'{w}'" for w in lacking[:3])
            reason = (f"no good match: nothing in {where} matches {names} (not found in the {len(hits)} best); "
                      f"the best has relevance {max(shown):.2f}")
        else:
            reason = f"no good match: no {what} reaches relevance {min_relevance:.2f} (the best has {max(shown):.2f})"
    return kept, weaker, {"min_relevance": min_relevance, "reason": reason}


ITEM: dict[Side, str] = {"images": "image", "sentences": "sentence"}  # one result of each side, in a reason


@dataclass(frozen=True)
class Shown(Generic[H]):
    """A page as it is shown: the query's relevance scale (None: the model has none), the results that reach the
    cut-off, those under it (`weaker`) and the cut-off with why nothing reaches it."""

    relevance: Relevance | None
    hits: list[H]
    weaker: list[H]
    cut: CutOff
    values: dict[int, float | None]  # the relevance each result of the page shows, by the result's id()

    def of(self, hit: H) -> float | None:
        """The relevance a result of the page shows (None: the model has no scale)."""
        return self.values[id(hit)]


def shown(bundle: Bundle, side: Side, page: Page[H], min_relevance: float | None) -> Shown[H]:
    """How a page of `side` ('images' for a sentence, 'sentences' for an image) is shown at `min_relevance`
    (None: no cut-off): its relevance read against the collection (`relevance_at`) once for the page, then
    `cut_off`. The one place the service, the command line and the API compose them."""
    rel = relevance_at(bundle, side, page.best, page.collection)
    values = relevances(page.hits, rel)
    hits, weaker, cut = cut_off(page.hits, values, min_relevance, ITEM[side], page.collection)
    return Shown(rel, hits, weaker, cut, {id(h): v for h, v in zip(page.hits, values, strict=True)})


def by_date_taken(hits: list[ImageHit]) -> list[ImageHit]:
    """Newest photo first (EXIF date taken); photos without a date after them; ties by score, then id."""
    def key(h: ImageHit) -> tuple[bool, float, float, int]:
        taken = None if h.place is None else h.place.taken
        return taken is None, -(taken or 0.0), -h.score, h.image_id

    return sorted(hits, key=key)


def relevance_of(score: float, relevance: Relevance | None, found: Found | None = None) -> float | None:
    return None if relevance is None else shown_relevance(score, relevance, found)


def missing_of(found: Found | None) -> list[str]:
    return [] if found is None else found.missing


def _box(box: list[float]) -> list[float]:
    return [round(float(v), 2) for v in box]


def match_out(m: FragmentMatch) -> FragmentMatchOut:
    """An alignment entry: its region only where what it names is found (or where the model reads no evidence)."""
    located = m.found is None or m.found >= FOUND
    return FragmentMatchOut(triplet=m.triplet, phrase=phrase_of(m.relation, m.words), relation=m.relation,
                            words=list(m.words), box=_box(m.box) if located else None,
                            fragment=int(m.fragment) if located else None, score=float(m.score),
                            label=m.label if located else None,
                            found=None if m.found is None else round(float(m.found), 4))


def phrase_of(relation: str, words: tuple[str, str]) -> str:
    return Triplet(relation, *words).phrase()


def image_result(hit: ImageHit, relevance: float | None = None) -> ImageResult:
    """A ranked image as answered, with the relevance it shows (`relevances`; None: none)."""
    pl = hit.place or Place()
    taken = None if pl.taken is None else datetime.fromtimestamp(pl.taken, UTC).replace(tzinfo=None).isoformat()
    return ImageResult(id=hit.image_id, name=hit.name, path=hit.file, url=image_url(hit.image_id),
                       thumbnail=thumbnail_url(hit.image_id), width=hit.width,
                       height=hit.height, score=float(hit.score),
                       relevance=relevance, missing=missing_of(hit.found), taken=taken, lat=pl.lat, lon=pl.lon,
                       alignment=[match_out(m) for m in hit.alignment])


def place_filter(body: SearchImagesRequest) -> PlaceFilter:
    """The request's date and place filters (already validated by the request model)."""
    near = None if body.near is None else Near(body.near.lat, body.near.lon, body.near.km)
    return PlaceFilter(None if body.taken_after is None else clock_seconds(body.taken_after),
                       None if body.taken_before is None else clock_seconds(body.taken_before), near)


def sentence_result(hit: SentenceHit, relevance: float | None = None) -> SentenceResult:
    """A ranked sentence as answered, with the relevance it shows (`relevances`; None: none)."""
    return SentenceResult(id=hit.sentence_id, text=hit.text, score=float(hit.score),
                          relevance=relevance, missing=missing_of(hit.found),
                          alignment=[match_out(m) for m in hit.alignment])


def region_result(hit: RegionHit) -> RegionResult:
    return RegionResult(image_id=hit.image_id, name=hit.name, path=hit.file, url=image_url(hit.image_id),
                        thumbnail=thumbnail_url(hit.image_id), width=hit.width, height=hit.height, box=_box(hit.box),
                        fragment=int(hit.fragment), score=float(hit.score), label=hit.label,
                        found=None if hit.found is None else round(float(hit.found), 4))


def image_out(rec: ImageRecord) -> ImageOut:
    return ImageOut(id=rec.image_id, name=rec.name, path=rec.file, url=image_url(rec.image_id), width=rec.width,
                    height=rec.height)


def explain_out(e: Explanation, sentence: str, took_ms: float, relevance: Relevance | None = None) -> ExplainResponse:
    return ExplainResponse(
        image_id=e.image_id, name=e.name, url=image_url(e.image_id), thumbnail=thumbnail_url(e.image_id),
        width=e.width, height=e.height, sentence=sentence, score=e.score,
        relevance=relevance_of(e.score, relevance, e.found), missing=missing_of(e.found), rank=e.rank,
        images=e.images,
        scope=e.scope, recalled=e.recalled,
        image_fragments=e.image_fragments, sentence_fragments=e.sentence_fragments,
        alignment=[match_out(m) for m in e.alignment],
        pairs=[PairOut(triplet=p.triplet, phrase=phrase_of(p.relation, p.words), relation=p.relation,
                       words=list(p.words), fragment=p.fragment, box=_box(p.box), score=p.score, cleared=p.cleared,
                       contribution=p.contribution, label=p.label)
               for p in e.pairs],
        took_ms=took_ms)
