"""Request and response bodies of the API (pydantic), and the one JSON error model."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fragsearch.index.ids import MAX_ID
from fragsearch.index.types import ExplainScope
from fragsearch.settings import DEFAULT_K

Box = list[float]  # [x0, y0, x1, y1] in the image's own pixels
EMPTY_TEXT = "empty_text"  # the validation error type of a blank sentence or phrase (service/errors.py: its code)

# Response examples shown in the OpenAPI document (tests/test_service.py validates each against its model).
_MATCH = {"triplet": "amod(dog, black)", "phrase": "black dog", "relation": "amod", "words": ["dog", "black"],
          "box": [12.0, 40.5, 230.0, 310.0], "fragment": 3, "score": 0.412, "label": "dog", "found": 0.93}
_IMAGE = {"id": 17, "name": "1000268201_693b08cb0e.jpg", "url": "/images/17",
          "thumbnail": "/images/17/thumbnail?size=256", "width": 500, "height": 375, "score": 0.0831,
          "relevance": 0.83, "missing": [], "alignment": [_MATCH]}
_SENTENCE = {"id": 2051, "text": "A black dog runs through the grass .", "score": 0.0794, "relevance": 0.79,
             "missing": [], "alignment": [_MATCH]}
PATH_DOC = ("the image file's path as the index holds it: relative to the collection folder (POSIX form) for a file "
            "under it, else absolute")
RELEVANCE_TEXT = ("how likely a person would call this result a match for the query, 0 to 1, in the collection "
                  "searched (its size counts: the best of many is not a good match by being the best), from the "
                  "score and, where the model has phrase evidence, whether each thing the sentence names is "
                  "found in the picture (a missing one pulls it down); fitted on the model's validation data; "
                  "below the default cut-off 0.5 a match is less likely than not. null when the model has none "
                  "(a checkpoint made before the scale existed)")
FOUND_DOC = ("the probability that what the fragment names is in the picture (phrase evidence: its best region "
             "read against typical images), 0 to 1; at 0.5 or more the thing is found and `box` is its region, "
             "below it is not found and `box` is null. null when the fragment names no thing (e.g. "
             "'aux(running, is)') or the model has no phrase evidence")
MISSING_DOC = ("the things the query names that are not found in the picture (phrase evidence), least likely "
               "first: why a result that ranks well may still not be a match; empty when all are found or the "
               "model has no phrase evidence")


def _example(example: dict[str, Any]) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": [example]})


class ErrorBody(BaseModel):
    code: str = Field(description="machine-readable reason, e.g. empty_sentence, no_fragments, not_an_image")
    message: str = Field(description="what was wrong, for people")
    details: list[dict[str, Any]] | None = Field(default=None, description="per-field validation errors, when any")


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer has this body."""

    model_config = _example({"error": {"code": "no_fragments", "message": "the sentence has no word the model knows",
                                       "details": None}})

    error: ErrorBody


def _encodable(value: str, what: str) -> str:
    """Text that UTF-8 can hold: a lone surrogate (JSON's "\\ud800" escape) is no character and would fail
    deep inside the parser and the tokenizer; refused here with where it is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_text", "the {what} is not valid Unicode text: a lone surrogate "
                                  "(U+{code}) at character {at}",
                                  {"what": what, "code": f"{ord(value[e.start]):04X}", "at": e.start}) from None
    return value


def _not_blank(value: str, what: str) -> str:
    """The one check of a text field: every sentence, phrase and triplet word of the API goes through it
    (valid Unicode, not blank)."""
    text = _encodable(value, what).strip()
    if not text:
        raise PydanticCustomError(EMPTY_TEXT, "the {what} is empty", {"what": what})
    return text


def _min_relevance_field() -> Any:
    return Field(default=None, ge=0.0, le=1.0, description="leave out results whose relevance is below this "
                 "(0 to 1; 0.5 = a match as likely as not); no result left -> an empty list and a `reason`")


def _offset_field() -> Any:
    return Field(default=0, ge=0, strict=True, description="ranks skipped: the page starts at rank offset + 1 "
                 "(offset + k at most the service's max_rank)")


class NearIn(BaseModel):
    lat: float = Field(ge=-90.0, le=90.0, description="latitude in degrees", examples=[48.8584])
    lon: float = Field(ge=-180.0, le=180.0, description="longitude in degrees", examples=[2.2945])
    km: float = Field(gt=0.0, le=20_016.0, description="radius in km (great-circle distance)", examples=[5.0])


def clock_seconds(when: date | datetime) -> float:
    """A date or time as the EXIF clock is stored: its wall-clock reading as if UTC (a time zone given is
    ignored: cameras write local time without one); a date is its midnight."""
    if not isinstance(when, datetime):
        when = datetime(when.year, when.month, when.day)
    return when.replace(tzinfo=UTC).timestamp()


class SearchImagesRequest(BaseModel):
    sentence: str = Field(description="a sentence describing the images wanted", examples=["a dog runs on the grass"])
    k: int = Field(default=DEFAULT_K, ge=1, strict=True, description="number of images (at most the service's k limit)")
    offset: int = _offset_field()
    min_relevance: float | None = _min_relevance_field()
    taken_after: datetime | date | None = Field(
        default=None, description="only photos taken at or after this date or time (EXIF date taken, the camera's "
        "clock; photos without one are left out)", examples=["2024-06-01"])
    taken_before: datetime | date | None = Field(
        default=None, description="only photos taken before this date or time (a date: before its midnight)",
        examples=["2024-09-01"])
    near: NearIn | None = Field(default=None, description="only photos whose EXIF GPS position is within `km` of "
                                "(`lat`, `lon`); photos without one are left out")
    sort: Literal["score", "taken"] = Field(
        default="score", description="score: the best match first; taken: the results that reach `min_relevance` "
        "(required with it), among the service's deepest rank, newest photo first (photos without an EXIF date "
        "last, then by score)")

    @field_validator("sentence")
    @classmethod
    def _sentence(cls, v: str) -> str:
        return _not_blank(v, "sentence")

    @model_validator(mode="after")
    def _sorted_after_a_cut_off(self) -> SearchImagesRequest:
        if self.sort == "taken" and self.min_relevance is None:
            raise ValueError("sort 'taken' orders the results that reach min_relevance: give min_relevance too")
        return self

    @model_validator(mode="after")
    def _dates_in_order(self) -> SearchImagesRequest:
        if self.taken_after is not None and self.taken_before is not None and \
                clock_seconds(self.taken_after) >= clock_seconds(self.taken_before):
            raise ValueError("taken_after must be earlier than taken_before")
        return self


WORD_PATTERN = r"^[^\s,()]{1,64}$"  # one token: no blanks, commas or brackets


class TripletIn(BaseModel):
    relation: str = Field(pattern=r"^[\w:<>-]{1,32}$", description="dependency relation, e.g. amod",
                          examples=["amod"])
    w1: str = Field(pattern=WORD_PATTERN, description="head word", examples=["dog"])
    w2: str = Field(pattern=WORD_PATTERN, description="dependent word", examples=["black"])

    @field_validator("relation", "w1", "w2")
    @classmethod
    def _word(cls, v: str) -> str:
        return _not_blank(v, "triplet word")


class SearchFragmentsRequest(BaseModel):
    """Exactly one of `phrase` or `triplet`."""

    phrase: str | None = Field(default=None, description="a short phrase, e.g. 'black dog'", examples=["black dog"])
    triplet: TripletIn | None = Field(default=None, description="a dependency triplet")
    k: int = Field(default=DEFAULT_K, ge=1, strict=True,
                   description="number of regions (at most the service's k limit)")
    offset: int = _offset_field()

    @field_validator("phrase")
    @classmethod
    def _phrase(cls, v: str | None) -> str | None:
        return None if v is None else _not_blank(v, "phrase")

    @model_validator(mode="after")
    def _one_of(self) -> SearchFragmentsRequest:
        if (self.phrase is None) == (self.triplet is None):
            raise ValueError("give exactly one of 'phrase' or 'triplet'")
        return self


LABEL_DOC = ("the region's name from the COCO detector (e.g. 'dog') where the model's regions come from it and "
             "its best class is confident (score >= 0.5); null otherwise (the whole image, a selective-search "
             "region, or a model whose regions carry no detector classes)")


class FragmentMatchOut(BaseModel):
    """One sentence fragment and the image region it aligns with."""

    triplet: str = Field(description="the fragment as text, e.g. 'amod(dog, black)'")
    phrase: str = Field(description="the fragment as words in reading order, e.g. 'black dog' ('dog jumps' for "
                        "nsubj(jumps, dog), 'whole sentence' for the whole-sentence fragment)")
    relation: str
    words: list[str] = Field(description="[w1, w2]")
    box: Box | None = Field(description="the box [x0, y0, x1, y1] in the image's pixels where the thing the "
                            "fragment names is (the model's grounder: its region's box fused with the likely "
                            "regions around it, each moved toward the thing by the grounder's box refiner; for a "
                            "fragment that names no thing, or a model without a grounder, its best-scoring "
                            "region's); null when what the fragment names is not found in the picture (`found` "
                            "below 0.5)")
    fragment: int | None = Field(description="index of the image fragment the box is drawn from (0 = whole image); "
                                 "null with `box`")
    score: float = Field(description="fragment score v_i . s_j of its best region: its share of S_kl")
    label: str | None = Field(default=None, description=LABEL_DOC)
    found: float | None = Field(default=None, description=FOUND_DOC)


class ImageResult(BaseModel):
    id: int
    name: str
    path: str = Field(default="", description=PATH_DOC)
    url: str = Field(description="where the original image file is served")
    thumbnail: str = Field(description="a thumbnail of it (GET /images/{id}/thumbnail?size=...)")
    width: int
    height: int
    score: float = Field(description="image-sentence score S_kl")
    relevance: float | None = Field(default=None, description=RELEVANCE_TEXT)
    taken: str | None = Field(default=None, description="date taken (EXIF, the camera's clock, ISO 8601 without a "
                              "time zone); null when the photo has none")
    lat: float | None = Field(default=None, description="EXIF GPS latitude; null when the photo has none")
    lon: float | None = Field(default=None, description="EXIF GPS longitude")
    missing: list[str] = Field(default_factory=list, description=MISSING_DOC)
    alignment: list[FragmentMatchOut]


class ExplainRequest(BaseModel):
    image_id: int = Field(ge=0, le=MAX_ID, strict=True, description="an indexed image's id")
    sentence: str = Field(description="the sentence the image is explained for", examples=["a dog runs on the grass"])

    @field_validator("sentence")
    @classmethod
    def _sentence(cls, v: str) -> str:
        return _not_blank(v, "sentence")


class PairOut(FragmentMatchOut):
    """One sentence fragment with one image fragment (not only its best)."""

    box: Box = Field(description="the image fragment's region [x0, y0, x1, y1] in the image's pixels")
    fragment: int = Field(description="index of the image fragment (0 = whole image)")
    cleared: bool = Field(description="v_i . s_j > 0: only such pairs count towards S_kl")
    contribution: float = Field(description="the pair's share of S_kl: max(0, v_i . s_j) / (|g_k| (|g_l| + n))")


class ExplainResponse(BaseModel):
    model_config = _example({
        "image_id": 17, "name": "1000268201_693b08cb0e.jpg", "url": "/images/17",
        "thumbnail": "/images/17/thumbnail?size=256", "width": 500, "height": 375, "sentence": "a black dog runs",
        "score": 0.0831, "rank": 1, "images": 1000, "scope": "collection", "recalled": True,
        "image_fragments": 20, "sentence_fragments": 2,
        "alignment": [_MATCH], "pairs": [{**_MATCH, "cleared": True, "contribution": 0.00294}], "took_ms": 15.0})

    image_id: int
    name: str
    url: str = Field(description="where the image file is served")
    thumbnail: str = Field(description="a thumbnail of it")
    width: int
    height: int
    sentence: str
    score: float = Field(description="the image-sentence score S_kl, as searches compute it")
    relevance: float | None = Field(default=None, description=RELEVANCE_TEXT)
    missing: list[str] = Field(default_factory=list, description=MISSING_DOC)
    rank: int = Field(description="the image's place by the exact score among the images ranked (1 = first; "
                      "ties to the smaller id)")
    images: int = Field(description="how many images were ranked")
    scope: ExplainScope = Field(
        description="'collection': every indexed image was ranked (a collection small enough to scan); "
                    "'candidates': the images the index recalls for the sentence, plus this one, as a search "
                    "ranks them")
    recalled: bool = Field(description="whether a search for the sentence can return this image (always true "
                           "when the whole collection is ranked)")
    image_fragments: int
    sentence_fragments: int
    alignment: list[FragmentMatchOut] = Field(description="each sentence fragment's best region, as in a search")
    pairs: list[PairOut] = Field(description="every (sentence fragment, image fragment) pair, sentence fragment "
                                 "by sentence fragment; for fragment models the contributions sum to the score")
    took_ms: float


class Paged(BaseModel):
    """The paging fields of a ranked answer."""

    offset: int = Field(default=0, description="the rank before the first result (the page starts at offset + 1)")
    next_offset: int | None = Field(default=None, description="offset of the next page; null on the last page")
    considered: int = Field(default=0, description="items the exact score ranked: the candidates the index recalled, "
                            "or the whole collection when it is scanned (regions, for a fragment search)")


WEAKER_DOC = ("the page's results under the cut-off (`min_relevance`), in ranking order, each with what it "
              "misses: shown after the good matches as weaker ones, never in `results`; empty without a cut-off")


class CutOff(BaseModel):
    """The relevance cut-off of a ranked answer."""

    min_relevance: float | None = Field(default=None, description="the cut-off applied (null: none)")
    reason: str | None = Field(default=None, description="why the list is empty when it is (no result reaches "
                               "the cut-off, naming the thing no result holds where there is one; or nothing "
                               "passes the filters); null otherwise")


class SearchImagesResponse(Paged, CutOff):
    model_config = _example({"sentence": "a black dog runs", "results": [_IMAGE], "took_ms": 27.4})

    sentence: str
    results: list[ImageResult]
    weaker: list[ImageResult] = Field(default_factory=list, description=WEAKER_DOC)
    took_ms: float


class SentenceResult(BaseModel):
    id: int
    text: str
    score: float = Field(description="image-sentence score S_kl")
    relevance: float | None = Field(default=None, description=RELEVANCE_TEXT)
    missing: list[str] = Field(default_factory=list, description=MISSING_DOC)
    alignment: list[FragmentMatchOut]


class AnnotateResponse(Paged, CutOff):
    model_config = _example({"width": 500, "height": 375, "results": [_SENTENCE], "took_ms": 212.0})

    width: int = Field(description="width of the decoded upload (boxes are in its pixels)")
    height: int
    results: list[SentenceResult]
    weaker: list[SentenceResult] = Field(default_factory=list, description=WEAKER_DOC)
    took_ms: float


class SimilarResponse(Paged):
    model_config = _example({
        "image_id": 17, "width": 500, "height": 375, "described_by": [_SENTENCE],
        "results": [{**_IMAGE, "id": 240, "url": "/images/240", "thumbnail": "/images/240/thumbnail?size=256"}],
        "took_ms": 130.0})

    image_id: int | None = Field(description="the query image's id (None for an upload)")
    width: int = Field(description="the query image's width (the descriptions' boxes are in its pixels)")
    height: int
    described_by: list[SentenceResult] = Field(description="the collection's sentences with the best S_kl for the "
                                               "query image, aligned to its regions: what explains the results "
                                               "(empty without a sentence collection)")
    results: list[ImageResult] = Field(description="images ranked by the cosine of their mean embedded fragment "
                                       "with the query's (`score`; `relevance` is null), each with the alignment "
                                       "of the descriptions' triplets to its regions")
    took_ms: float


class DuplicateOut(BaseModel):
    id: int
    name: str
    url: str
    thumbnail: str
    similarity: float = Field(description="cosine of the two images' whole-frame fragments (1 = the same)")


class DuplicatesResponse(BaseModel):
    model_config = _example({"image_id": 17, "threshold": 0.95, "took_ms": 3.1, "duplicates": [
        {"id": 240, "name": "beach-small.jpg", "url": "/images/240", "thumbnail": "/images/240/thumbnail?size=256",
         "similarity": 0.987}]})

    image_id: int
    threshold: float = Field(description="the cosine at or above which an image is listed")
    duplicates: list[DuplicateOut] = Field(description="near-duplicates (resized, re-encoded, slightly cropped "
                                           "copies), most alike first; empty when there are none")
    took_ms: float


class RegionResult(BaseModel):
    image_id: int
    name: str
    path: str = Field(default="", description=PATH_DOC)
    url: str = Field(description="where the original image file is served")
    thumbnail: str = Field(default="", description="a thumbnail of it (GET /images/{id}/thumbnail?size=...)")
    width: int = Field(default=0, description="the original's width in pixels (the box is in its pixels)")
    height: int = Field(default=0, description="the original's height in pixels")
    box: Box
    fragment: int
    score: float = Field(description="fragment score v_i . s")
    label: str | None = Field(default=None, description=LABEL_DOC)
    found: float | None = Field(default=None, description="the probability that what the phrase names is in the "
                                "image (phrase evidence, the least likely of its things); null when it names no "
                                "thing or the model has no phrase evidence")


class SearchFragmentsResponse(Paged):
    model_config = _example({
        "query": "black dog", "took_ms": 18.2,
        "results": [{"image_id": 17, "name": "1000268201_693b08cb0e.jpg", "url": "/images/17",
                     "box": [12.0, 40.5, 230.0, 310.0], "fragment": 3, "score": 0.62, "label": "dog"}]})

    query: str
    results: list[RegionResult]
    took_ms: float


class ImageOut(BaseModel):
    model_config = _example({"id": 1001, "name": "beach.jpg", "url": "/images/1001", "width": 640, "height": 480})

    id: int
    name: str
    path: str = Field(default="", description=PATH_DOC)
    url: str
    width: int
    height: int


class Health(BaseModel):
    status: str


class WatchOut(BaseModel):
    """The watched collection folder (service/watch.py)."""

    folder: str
    watching: bool = Field(description="file-system events are followed (false: only the periodic rescan)")
    backlog: int = Field(description="files changed and not yet applied to the index")
    syncs: int = Field(description="syncs applied since the start")
    last_sync: float | None = Field(description="when the last sync finished (seconds since 1970)")
    last_report: str = Field(description="what it did: added, changed, renamed, removed ...")
    last_error: str | None = Field(description="why the last sync failed, when it did (it is tried again)")


class Ready(BaseModel):
    status: str
    images: int = Field(description="images in the index")
    sentences: int = Field(description="sentences in the collection")
    load_seconds: float
    relevance: bool = Field(default=False, description="whether results carry a relevance (the model has the "
                            "scale) and `min_relevance` is accepted")
    default_min_relevance: float = Field(default=0.5, description="the cut-off the page starts with")
    watch: WatchOut | None = Field(default=None, description="the watched collection folder, when one is served")


class PrepareProgress(BaseModel):
    """How far the preparation got (service/prepare.py Progress)."""

    stage: str = Field(description="model, image index, sentence index, loading")
    detail: str = ""
    step: str | None = Field(default=None, description="the step under way (its progress bar's label)")
    done: int | None = Field(default=None, description="items of the step done")
    total: int | None = Field(default=None, description="items of the step in all")
    eta_seconds: float | None = Field(default=None, description="estimated seconds left in the step")
    elapsed_seconds: float
    stages_done: list[str] = []
    stages_left: list[str] = []


class NotReady(ErrorResponse):
    """GET /readyz before the service is ready: the error body plus what is still being prepared."""

    status: str = Field(description="preparing, loading or failed")
    progress: PrepareProgress | None = None
    serving: list[str] = Field(default=[], description="routes that answer already")
