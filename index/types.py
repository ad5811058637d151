"""Settings, results and errors of the fragment indexes."""

from __future__ import annotations

import dataclasses
import errno
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from fragsearch.index.places import Place
from fragsearch.model.config import described
from fragsearch.model.evidence import Found

BACKENDS = ("faiss", "milvus")


@dataclass(frozen=True)
class BackendOptions:
    """Where a backend keeps its vectors: `backend` "faiss" or "milvus"; `uri` of a Milvus server
    ("http://host:19530") or a milvus-lite folder ("path/file.db"); None: the index's default (for
    Milvus, the URI it was built with, or `milvus.db` inside the index folder)."""

    backend: str = "faiss"
    uri: str | None = None
    token: str | None = None  # a Milvus server's credentials ("user:password" or an API key)
    mapped: bool = False  # FAISS: a loaded index's vectors stay in its file's mapping (index/ann.py FaissCandidates)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")


KINDS = ("flat", "hnsw", "ivf", "ivfpq")
STORE_DTYPES = ("float32", "float16", "int8")
CANDIDATE_DTYPES = ("float32", "float16")  # a flat index's copy of the vectors (FAISS Flat, or SQfp16)


class IndexLoadError(ValueError):
    """An index folder is missing, corrupt, or was built for another model or dimension."""


class IndexFullError(OSError):
    """A save ran out of disk space (ENOSPC); the last committed state is what the folder holds."""

    def __init__(self, root: object, cause: BaseException) -> None:
        super().__init__(errno.ENOSPC, f"no space left to save the index at {root} ({cause}); the last saved "
                         "state is kept")


@dataclass(frozen=True)
class IndexShape:
    """What a saved index is: the stored FAISS index's structure, the re-rank store's precision and the
    prescore codes it keeps. Saved with the index (its `info`); changing a field means a rebuild.

    kind: "flat" (exact inner product), "hnsw" (graph), "ivf" (inverted lists, raw vectors) or
    "ivfpq" (inverted lists, product-quantised codes). `pretransform` is an optional FAISS
    pre-transform in index-factory syntax ("PCA256", "OPQ50_500") applied before hnsw / ivf / ivfpq.
    `candidate_dtype` (flat only): the precision of the candidate stage's copy of the vectors, float32 (FAISS
    Flat) or float16 (FAISS SQfp16: half the memory; the candidates' partial scores differ by float16 rounding,
    the exact re-rank reads the store).
    `store_dtype`: precision of the re-rank store (the vectors the exact score reads): float32, float16
    (half the bytes; the choice for large collections, `large_collection`), int8 (a quarter plus 4 bytes
    a fragment: per-fragment scale, index.store; image indexes only).
    `codes` d > 0 keeps a d-dimensional int8 prescore code of every stored fragment (d + 4 bytes,
    index.codes; `FragmentIndex.add_codes` gives an index built without them its codes).
    `refine_codes` d2 > 0 keeps a second, refining code of every fragment (on the directions the first
    leaves out, also in memory), for `SearchSettings.refine`.
    """

    kind: str = described("flat", "FAISS index kind of the candidate stage", choices=KINDS)
    nlist: int = described(1024, "inverted lists (ivf, ivfpq)")
    m: int = described(32, "product-quantiser sub-vectors (ivfpq); must divide the (pre-transformed) dimension")
    nbits: int = described(4, "bits per sub-vector code (ivfpq); 4 uses FAISS fast-scan codes")
    hnsw_m: int = described(32, "HNSW neighbours per node")
    ef_construction: int = described(40, "HNSW build beam")
    pretransform: str = described("", 'FAISS pre-transform before hnsw / ivf / ivfpq, e.g. "PCA256"')
    store_dtype: str = described("float32", "precision of the re-rank store of fragment vectors",
                                choices=STORE_DTYPES)
    candidate_dtype: str = described("float32", "precision of a flat index's candidate copy of the vectors "
                                    "(float16: half the memory)", choices=CANDIDATE_DTYPES)
    train_size: int = described(0, "vectors collected before ivf / ivfpq is trained (0: 39 per list, and "
                               "39 * 2^nbits)")
    codes: int = described(0, "dimensions of the prescore codes of every stored fragment (0: none; large "
                          "collections: 64)")
    refine_codes: int = described(0, "with codes: dimensions of a second, refining code of every fragment (0: none)")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"index kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.store_dtype not in STORE_DTYPES:
            raise ValueError(f"store_dtype must be one of {', '.join(STORE_DTYPES)}, got {self.store_dtype!r}")
        if self.candidate_dtype not in CANDIDATE_DTYPES:
            raise ValueError(f"candidate_dtype must be one of {', '.join(CANDIDATE_DTYPES)}, "
                             f"got {self.candidate_dtype!r}")
        if self.candidate_dtype != "float32" and self.kind != "flat":
            raise ValueError(f"candidate_dtype {self.candidate_dtype} is a flat index's (kind {self.kind!r} keeps "
                             "its own codes)")
        for name in ("nlist", "m", "nbits", "hnsw_m", "ef_construction"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.train_size < 0:
            raise ValueError(f"train_size must be >= 0, got {self.train_size}")
        if self.codes < 0:
            raise ValueError(f"codes must be >= 0 (0: no prescore codes), got {self.codes}")
        if self.refine_codes < 0 or (self.refine_codes and not self.codes):
            raise ValueError(f"refine_codes must be >= 0 and needs codes > 0, got {self.refine_codes} "
                             f"with codes {self.codes}")

    @property
    def trainable(self) -> bool:
        """Kinds that learn centroids / codebooks before they can hold vectors."""
        return self.kind in ("ivf", "ivfpq") or (self.kind == "hnsw" and bool(self.pretransform))

    def train_threshold(self) -> int:
        """Vectors collected before training: enough for k-means on every list and codebook."""
        if self.train_size:
            return self.train_size
        need = 39 * self.nlist if self.kind in ("ivf", "ivfpq") else 10_000
        if self.kind == "ivfpq":
            need = max(need, 39 * (1 << self.nbits))
        return need

    def factory(self) -> str:
        """The FAISS index-factory string of the target index (inner-product metric)."""
        pre = f"{self.pretransform}," if self.pretransform else ""
        if self.kind == "flat":
            return "IDMap,SQfp16" if self.candidate_dtype == "float16" else "IDMap,Flat"
        if self.kind == "hnsw":
            return f"IDMap,{pre}HNSW{self.hnsw_m}"
        if self.kind == "ivf":
            return f"{pre}IVF{self.nlist},Flat"
        codes = f"PQ{self.m}x4fs" if self.nbits == 4 else f"PQ{self.m}x{self.nbits}"  # 4 bits: fast-scan
        return f"{pre}IVF{self.nlist},{codes}"


@dataclass(frozen=True)
class SearchSettings:
    """How a search walks the candidate cascade (index.ranker); changed at any time (`set_search`, or
    the overrides of a load) without a rebuild.

    `k_prime`: neighbours fetched per query fragment in the candidate stage (0: every fragment with a
    positive score, by range search; meant with `rerank`, for collections that share fragments).
    `rerank` R > 0 keeps the R candidates with the best partial score (their retrieved fragments'
    positive FAISS scores, summed and normalised as S_kl is) for the exact re-rank: fetch many, score few.
    With prescore codes (`IndexShape.codes`) and `rerank` R, a search scores its candidates
    approximately on their codes (the exact score of the decoded codes against the projected queries)
    and reads the full vectors of the R best only; `prescore` P > 0 first keeps the P candidates with
    the best partial score for that (0: all of them). With refining codes, `refine` N > 0 keeps the N
    candidates with the best score on the first code and scores them on both codes before the cut to
    the R best (0: no second step).
    `summaries` S > 0 (with codes and `rerank`): the first cut is a scan of every live item's summary
    (its mean first code, index.codes) keeping the S best instead of the candidate backend's recall and
    partial score; `prescore` then does not apply (the S are scored on their codes). A search with a
    date or place filter still uses the candidate backend.
    `exact_below`: a collection of at most this many live fragments is searched by the exact score over
    every item, without the candidate stage (at that size the scan costs less than the candidate
    search and agrees with the exact ranking by definition); 0 always uses the candidates.
    """

    ef_search: int = described(128, "HNSW search beam")
    nprobe: int = described(32, "IVF lists searched per query fragment (ivf, ivfpq)")
    k_prime: int = described(128, "neighbours per query fragment (0: every one with a positive score)")
    rerank: int = described(0, "score exactly only the R candidates with the best partial score (0: all)")
    use_gpu: bool = described(False, "search on a GPU copy where faiss-gpu and a GPU are present")
    exact_below: int = described(50_000, "live fragments under which a search scans every item exactly "
                                "(0: always the candidates)")
    prescore: int = described(0, "with codes and rerank: candidates (by partial score) whose codes are scored "
                             "(0: all)")
    refine: int = described(0, "with refine_codes: candidates (by the first code's score) scored on both codes "
                           "(0: none)")
    summaries: int = described(0, "with codes and rerank: the first cut is a scan of every item's summary (its "
                              "mean code) keeping this many, instead of the candidate backend's (0: the backend's)")

    def __post_init__(self) -> None:
        for name in ("ef_search", "nprobe"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.k_prime < 0:
            raise ValueError(f"k_prime must be >= 0 (0: every neighbour with a positive score), got {self.k_prime}")
        if self.rerank < 0:
            raise ValueError(f"rerank must be >= 0, got {self.rerank}")
        if self.exact_below < 0:
            raise ValueError(f"exact_below must be >= 0, got {self.exact_below}")
        if self.prescore < 0:
            raise ValueError(f"prescore must be >= 0 (0: every candidate), got {self.prescore}")
        if self.refine < 0:
            raise ValueError(f"refine must be >= 0 (0: no second step), got {self.refine}")
        if self.summaries < 0:
            raise ValueError(f"summaries must be >= 0 (0: the candidate backend's first cut), got {self.summaries}")


SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(IndexShape))
SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(SearchSettings))
# the order of the fields in a saved index's `info` (that of the one type both were before)
SAVED_ORDER = ("kind", "nlist", "m", "nbits", "hnsw_m", "ef_construction", "ef_search", "nprobe", "k_prime", "rerank",
               "pretransform", "store_dtype", "train_size", "use_gpu", "exact_below", "codes", "prescore",
               "refine_codes", "refine", "summaries", "candidate_dtype")


@dataclass(frozen=True)
class IndexSettings:
    """An index's settings: its `shape` (saved, a rebuild to change) and its `search` settings.
    `IndexSettings.of(kind="ivf", k_prime=64)` takes the fields of both by name."""

    shape: IndexShape = field(default_factory=IndexShape)
    search: SearchSettings = field(default_factory=SearchSettings)

    @classmethod
    def of(cls, **fields: Any) -> IndexSettings:
        """Settings from the fields of both types by name (TypeError for an unknown one)."""
        unknown = sorted(set(fields) - set(SHAPE_FIELDS) - set(SEARCH_FIELDS))
        if unknown:
            raise TypeError(f"unknown index settings: {', '.join(unknown)}")
        return cls(IndexShape(**{k: v for k, v in fields.items() if k in SHAPE_FIELDS}),
                   SearchSettings(**{k: v for k, v in fields.items() if k in SEARCH_FIELDS}))

    def describe(self) -> str:
        """Short parameter string for logs and benchmark tables."""
        shape, search = self.shape, self.search
        parts = [f"k_prime={search.k_prime or 'positive'}", f"store={shape.store_dtype}"]
        if shape.candidate_dtype != "float32":
            parts.insert(0, f"candidates={shape.candidate_dtype}")
        if search.rerank:
            parts.insert(1, f"rerank={search.rerank}")
        if shape.codes:
            parts.insert(1, f"codes={shape.codes}" + (f";prescore={search.prescore}" if search.prescore else "")
                         + (f";refine_codes={shape.refine_codes};refine={search.refine}" if shape.refine_codes else "")
                         + (f";summaries={search.summaries}" if search.summaries else ""))
        if shape.pretransform:
            parts.insert(0, f"pre={shape.pretransform}")
        if shape.kind in ("ivf", "ivfpq"):
            parts[:0] = [f"nlist={shape.nlist}", f"nprobe={search.nprobe}"]
        if shape.kind == "ivfpq":
            parts.insert(1, f"m={shape.m}x{shape.nbits}")
        if shape.kind == "hnsw":
            parts[:0] = [f"M={shape.hnsw_m}", f"ef_search={search.ef_search}"]
        return ";".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The fields of both, by name, in one mapping: the form an index folder saves (its `info`)."""
        both = {**dataclasses.asdict(self.shape), **dataclasses.asdict(self.search)}
        return {name: both[name] for name in SAVED_ORDER}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexSettings:
        return cls.of(**{k: v for k, v in data.items() if k in SHAPE_FIELDS or k in SEARCH_FIELDS})

    def with_search(self, **changes: Any) -> IndexSettings:
        """A copy with search-time fields changed (nprobe, ef_search, k_prime, rerank, prescore, refine,
        use_gpu, exact_below, summaries)."""
        bad = sorted(set(changes) & set(SHAPE_FIELDS))
        if bad:
            raise ValueError(f"{', '.join(bad)} shape the stored index: rebuild it to change them")
        return dataclasses.replace(self, search=dataclasses.replace(self.search, **changes))

    def with_shape(self, **changes: Any) -> IndexSettings:
        """A copy with fields of the shape changed (for a new index, or a rebuild)."""
        return dataclasses.replace(self, shape=dataclasses.replace(self.shape, **changes))


@dataclass
class FragmentMatch:
    """One sentence fragment of a result and the image fragment it aligns with.

    box: [x0, y0, x1, y1] in the pixels of the image the fragment belongs to: where the thing the fragment names
    is, by the model's grounder (model/grounder.py: its region `fragment`'s box fused with the likely regions
    around it, each moved toward the thing by its box refiner), else the fragment's best-scoring region's; score:
    its share
    of S_kl, the best region's v_i . s_j (a merged model's thresholded pair score); label: the
    COCO name of the region's confident detector class (model/features.py ``fragment_labels``), None when it
    has none or the model's regions carry no classes.
    """

    triplet: str
    relation: str
    words: tuple[str, str]
    box: list[float]
    fragment: int
    score: float
    label: str | None = None
    found: float | None = None  # the probability that what it names is in the picture (model/evidence.py)


@dataclass
class ImageHit:
    image_id: int
    name: str
    path: str
    width: int
    height: int
    score: float
    alignment: list[FragmentMatch] = field(default_factory=list)
    place: Place | None = None  # when and where it was taken (EXIF), None when not read
    file: str = ""  # the path as stored: relative to the collection folder when under it (POSIX), else absolute
    found: Found | None = None  # the query's phrase evidence in it (None: the model has none)


@dataclass
class SentenceHit:
    sentence_id: int
    text: str
    score: float
    alignment: list[FragmentMatch] = field(default_factory=list)
    found: Found | None = None  # its phrase evidence in the query image (None: the model has none)


@dataclass
class RegionHit:
    """An image region scored against a phrase (the sum of its positive fragment scores)."""

    image_id: int
    name: str
    box: list[float]
    fragment: int
    score: float
    label: str | None = None  # the region's detector label (FragmentMatch.label)
    width: int = 0  # the image's size (the box is in its pixels)
    height: int = 0
    file: str = ""  # the path as stored (as ImageHit.file)
    found: float | None = None  # the probability that the phrase's things are in the image (model/evidence.py)


H = TypeVar("H")


@dataclass
class Page(Generic[H]):
    """One page of a ranking: `hits` are ranked offset + 1, offset + 2, ...; `considered` items were
    scored exactly (the candidates, or every item when the collection is scanned)."""

    hits: list[H]
    offset: int
    considered: int
    # the best scores of the considered items (up to model.calibration.RELEVANCE_TOP + 1), best first: what
    # a result's relevance compares it with (Relevance.for_query)
    best: np.ndarray = field(default_factory=lambda: np.zeros(0))
    collection: int = 0  # the items of the collection searched (every live one, or those passing a filter)


@dataclass
class PairShare:
    """One (sentence fragment, image fragment) pair of an explained score: its v_i . s_j, whether it
    clears the threshold (v_i . s_j > 0: only those count) and its share of S_kl."""

    triplet: str
    relation: str
    words: tuple[str, str]
    fragment: int
    box: list[float]
    score: float
    cleared: bool
    contribution: float
    label: str | None = None  # the image fragment's detector label (FragmentMatch.label)


ExplainScope = Literal["collection", "candidates"]  # what an explained rank is taken over


@dataclass
class Explanation:
    """Why an image scores what it does for a sentence: S_kl, the rank the exact score gives it among
    `images` ranked images (ties to the smaller id, as searches rank), its alignment and every pair.

    `scope` is "collection" when every live image was ranked (a collection a search scans whole), or
    "candidates" when only the images the index recalls for the sentence were, plus this one, as a
    search ranks them; `recalled` says whether the index recalled it (a search can return it)."""

    image_id: int
    name: str
    width: int
    height: int
    score: float
    rank: int
    images: int
    image_fragments: int
    sentence_fragments: int
    alignment: list[FragmentMatch]
    pairs: list[PairShare]
    scope: ExplainScope = "collection"
    recalled: bool = True
    best: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the best scores of the images ranked
    collection: int = 0  # the live images of the collection
    found: Found | None = None  # the sentence's phrase evidence in the image (None: the model has none)


@dataclass
class ImageRecord:
    """An indexed image: boxes (F, 4) of its fragments in its own pixels, row 0 the whole image, and their
    detector labels (FragmentMatch.label; empty when the model's regions carry no classes)."""

    image_id: int
    name: str
    path: str
    width: int
    height: int
    boxes: list[list[float]]
    labels: tuple[str | None, ...] = ()
    file: str = ""  # the path as stored: relative to the collection folder when under it (POSIX), else absolute


@dataclass
class SentenceRecord:
    """An indexed sentence and the fragments (triplet texts) stored for it, in row order."""

    sentence_id: int
    text: str
    triplets: list[str]


@dataclass
class AddReport:
    """What add_paths did: ids of the images added, files skipped (path, reason), paths already indexed."""

    added: list[int] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    present: int = 0
