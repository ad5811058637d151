"""The FAISS candidate backend: inner-product search over fragment vectors, one class for every kind,
saved as a `faiss-*.index` file of the index folder at each commit (index.saving), its checksum in
the catalogue's `info`.

Ids are `fragsearch.index.ids` fragment ids. Trainable kinds (ivf, ivfpq, or hnsw behind a pre-transform)
start as an exact flat index and are built for real by `FaissCandidates.build` once enough vectors exist.
hnsw cannot delete: its removed fragments stay in the graph and are filtered by the caller.
With `use_gpu` and faiss-gpu with a GPU present, each call runs where `fragsearch.model.device.placement` says:
k-NN searches on a GPU copy of the index (index.gpu: one call at a time), range searches never there.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from faiss.contrib.exhaustive_search import range_search_gpu
from tqdm import tqdm

from fragsearch.index import ids as fid
from fragsearch.index.candidates import CandidateBackend, Sources
from fragsearch.index.files import sha256_file, unique_name
from fragsearch.index.gpu import GpuCopy, faiss_gpu
from fragsearch.index.store import mapping_of, release_mapped
from fragsearch.index.types import IndexLoadError, IndexSettings
from fragsearch.model.atomic import atomic_path
from fragsearch.model.device import CALLS, FAISS_GPU, FAISS_GPU_MAX_K, GPU_KNN_CPU_RANGE, MATRIX_CPU, placement
from fragsearch.model.product import product

logger = logging.getLogger(__name__)

PCA_RE = re.compile(r"^PCA(\d+)$")
TRAIN_SAMPLE_PER_LIST = 64  # training vectors per inverted list (FAISS asks for 39..256)
MAX_TRAIN_SAMPLE = 200_000
POSITIVE_CHUNK = 1 << 15  # stored vectors scored per matrix product in search_positive (bounds memory: a file's
# mapped rows are let go chunk by chunk)
FAISS_PREFIX, FAISS_SUFFIX = "faiss", ".index"


def _unwrap(index: faiss.Index) -> faiss.Index:
    """The index inside IDMap / pre-transform wrappers."""
    index = faiss.downcast_index(index)
    while isinstance(index, faiss.IndexIDMap | faiss.IndexIDMap2 | faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return index


def gpu_available() -> bool:
    """faiss-gpu is installed and sees a GPU."""
    return faiss_gpu() is not None


class FaissCandidates(CandidateBackend):
    """The in-process FAISS index over fragment vectors (inner product), with the search parameters
    applied, saved as a file of the index folder.

    An index opened `mapped` (the service's `candidates_mapped`) keeps its stored vectors in its file (FAISS's
    IO_FLAG_MMAP_IFC: the flat codes are a read-only memory mapping of it) until it is first written to, when
    they are read into memory. A flat index's recall (`search_positive`) reads the mapped vectors chunk by
    chunk and lets each chunk's pages go after its product: the process holds none of them between searches,
    the kernel's cache keeps them (the sentence index of 30,000 captions: 490 MB that a loaded service no
    longer holds), and each scan maps them again."""

    NAME = "faiss"

    def __init__(self, dim: int, settings: IndexSettings, index: faiss.Index | None = None,
                 trained: bool = False, file: str = "", sha: str = "") -> None:
        self.dim = dim
        self.settings = settings
        if index is None:
            trained = not settings.shape.trainable
            index = new_index(dim, IndexSettings() if settings.shape.trainable else settings)
        if index.d != dim:
            raise ValueError(f"FAISS index has dimension {index.d}, expected {dim}")
        self.index = index
        self._trained = trained  # True when `index` is of the target kind (not the flat stand-in)
        self._gpu: GpuCopy | None = None
        self._gpu_lock = threading.Lock()
        self._gpu_warned = False
        self._file, self._sha = file, sha  # the committed file and its checksum
        self._dirty = not file
        self._mapped: Path | None = None  # the file whose mapping holds the stored vectors (`open`), until a write
        self._apply_search_params()

    @classmethod
    def create(cls, dim: int, settings: IndexSettings) -> FaissCandidates:
        return cls(dim, settings)

    @classmethod
    def open(cls, root: Path, dim: int, settings: IndexSettings, info: dict[str, Any], mapped: bool = False
             ) -> FaissCandidates:
        """The FAISS file the committed `info` names (IndexLoadError when missing, corrupt or unreadable); with
        `mapped`, its stored vectors left in the file (read-only mapping) until the first write."""
        where = f"index at {root}"
        file = str(info.get("ann_file", ""))
        path = Path(root) / file
        if not file or not path.is_file():
            raise IndexLoadError(f"{where}: FAISS file {file or '(none)'} is missing")
        if sha256_file(path) != info.get("ann_sha256"):
            raise IndexLoadError(f"{where}: FAISS file {file} is corrupt (checksum mismatch)")
        try:
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC) if mapped else faiss.read_index(str(path))
            out = cls(dim, settings, index, bool(info["ann_trained"]), file, str(info["ann_sha256"]))
        except (RuntimeError, ValueError) as e:
            raise IndexLoadError(f"{where}: FAISS file {file} is unreadable: {e}") from e
        out._mapped = path if mapped else None
        if out.ntotal != int(info["ann_ntotal"]):
            raise IndexLoadError(f"{where}: FAISS file holds {out.ntotal} fragments, metadata says "
                                 f"{info['ann_ntotal']}")
        return out

    # -- properties -------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def trained(self) -> bool:
        return self._trained

    @property
    def active_kind(self) -> str:
        return self.settings.shape.kind if self.trained else "flat"

    @property
    def supports_remove(self) -> bool:
        return self.active_kind != "hnsw"

    def placement(self, call: str, k: int = 1) -> str:
        """Where `call` runs for this index now (model.device.placement)."""
        gpu = self.settings.search.use_gpu and gpu_available()
        return placement(call, self.active_kind, gpu, self.settings.shape.nbits, k)

    def policy(self) -> dict[str, str]:
        """Every call's placement, for the start-up log."""
        return {call: self.placement(call) for call in CALLS}

    def needs_build(self, n_vectors: int) -> bool:
        """True when a trainable kind still runs as the flat stand-in and has enough vectors to train."""
        return not self.trained and self.settings.shape.trainable and n_vectors >= self.settings.shape.train_threshold()

    # -- settings ---------------------------------------------------------------------------------
    def set_settings(self, settings: IndexSettings) -> None:
        """New search-time settings (the stored structure must stay the same)."""
        self.settings = settings
        self._gpu = None
        self._apply_search_params()

    def _apply_search_params(self) -> None:
        if not self.trained:
            return
        inner = _unwrap(self.index)
        if isinstance(inner, faiss.IndexIVF):
            inner.nprobe = self.settings.search.nprobe
        if isinstance(inner, faiss.IndexHNSW):
            inner.hnsw.efSearch = self.settings.search.ef_search

    # -- writes -----------------------------------------------------------------------------------
    def _own(self) -> None:
        """Before a write: the stored vectors read into memory, where they are still the file's mapping (from the
        file, unchanged since it was opened: a write comes first; from the mapping when the file is gone)."""
        if self._mapped is None:
            return
        if self._mapped.is_file():
            self.index = faiss.read_index(str(self._mapped))
        else:
            self.index = faiss.deserialize_index(faiss.serialize_index(self.index))
        self._mapped = None
        self._gpu = None
        self._apply_search_params()

    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        """ids: (n,) int64 fragment ids; vecs: (n, dim) float32."""
        if len(ids) == 0:
            return
        self._own()
        self.index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), np.ascontiguousarray(ids, np.int64))
        self._gpu = None
        self._dirty = True

    def remove_item(self, item: int) -> int:
        """Remove every fragment of `item`; returns how many were removed (0 where deletion is unsupported)."""
        if not self.supports_remove:
            return 0
        lo, hi = fid.item_range(item)
        self._own()
        n = int(self.index.remove_ids(faiss.IDSelectorRange(lo, hi)))
        self._gpu = None
        self._dirty |= n > 0
        return n

    def remove_ids(self, ids: Sequence[int] | np.ndarray) -> int:
        """Remove fragments by id; returns how many were removed (0 where deletion is unsupported)."""
        if not self.supports_remove or not len(ids):
            return 0
        self._own()
        n = int(self.index.remove_ids(faiss.IDSelectorBatch(np.asarray(ids, dtype=np.int64))))
        self._gpu = None
        self._dirty |= n > 0
        return n

    # -- search -----------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """queries: (t, dim) float32 -> scores (t, k) and fragment ids (t, k) (-1 where fewer exist);
        `items` is filtered by the caller."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        k = max(1, min(k, max(1, self.ntotal)))
        copy = self._gpu_copy() if self.placement("knn", k) == FAISS_GPU else None
        scores, ids = (copy or self.index).search(q, k)
        return scores, ids

    def search_positive(self, queries: np.ndarray, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every fragment with a positive score for some query, with its positive scores: scores (N,)
        and fragment ids (N,), to be summed per fragment (a fragment may come once per query).

        A flat index gives each fragment once, with the sum over the queries of its positive scores,
        from matrix products over its stored vectors on the CPU (model/product.py), with or without a GPU (the same
        numbers as a range search, without collecting every (query, fragment) pair); other kinds
        range-search (radius 0), approximate ones returning the fragments they visit: on the CPU, or
        as k-NN on the GPU copy with the CPU index for the queries whose neighbours are all positive
        (FAISS's GPU indexes have no range search)."""
        if self.ntotal == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        where = self.placement("range")
        stored = self._flat_vectors() if where == MATRIX_CPU else None
        if stored is not None:
            vecs, ids = stored
            mapping = mapping_of(self._mapped, vecs.ctypes.data) if self._mapped is not None and len(vecs) else None
            sums = np.empty(len(vecs), np.float32)
            for start in range(0, len(vecs), POSITIVE_CHUNK):
                rows = vecs[start : start + POSITIVE_CHUNK]
                part = product(rows.astype(np.float32, copy=False), q)
                np.maximum(part, 0.0, out=part)
                sums[start : start + len(part)] = part.sum(axis=1)
                if mapping is not None:  # the file's pages go back to the kernel's cache
                    release_mapped(mapping, rows.ctypes.data, rows.ctypes.data + rows.nbytes)
            hit = sums > 0
            return sums[hit], ids[hit]
        copy = self._gpu_copy() if where == GPU_KNN_CPU_RANGE else None
        if copy is not None:
            _, scores, ids = range_search_gpu(q, 0.0, copy, self.index, gpu_k=FAISS_GPU_MAX_K)
        else:
            _, scores, ids = self.index.range_search(q, 0.0)
        return scores, ids

    def _flat_vectors(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The stored vectors (N, dim) (a view, no copy) and their ids (N,) of an exact flat index;
        None for other kinds (read under the owner's read lock: a write may move them)."""
        outer = faiss.downcast_index(self.index)
        if not isinstance(outer, faiss.IndexIDMap | faiss.IndexIDMap2):
            return None
        inner = faiss.downcast_index(outer.index)
        if inner.metric_type != faiss.METRIC_INNER_PRODUCT:
            return None
        n = int(inner.ntotal)
        if isinstance(inner, faiss.IndexFlat):
            vecs = faiss.rev_swig_ptr(inner.get_xb(), n * self.dim).reshape(n, self.dim)
        elif isinstance(inner, faiss.IndexScalarQuantizer) and inner.sq.qtype == faiss.ScalarQuantizer.QT_fp16:
            raw = faiss.rev_swig_ptr(inner.codes.data(), n * self.dim * 2) if n else np.zeros(0, np.uint8)
            vecs = raw.view(np.float16).reshape(n, self.dim)  # SQfp16's codes are the float16 values themselves
        else:
            return None
        return vecs, faiss.vector_to_array(outer.id_map)

    def _gpu_copy(self) -> GpuCopy | None:
        """The index's GPU copy (made when missing), or None where it cannot be made."""
        gpu = faiss_gpu()
        if gpu is None:
            return None
        with self._gpu_lock:
            if self._gpu is None:
                try:
                    self._gpu = gpu.copy(self.index)
                except RuntimeError as e:  # settings FAISS's GPU version refuses (e.g. its PQ sizes)
                    if not self._gpu_warned:
                        logger.warning("this index cannot move to the GPU (%s): searching on the CPU", e)
                        self._gpu_warned = True
                    return None
            return self._gpu

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, dim: int, settings: IndexSettings, train: np.ndarray,
              batches: Iterable[tuple[np.ndarray, np.ndarray]], total: int | None = None) -> FaissCandidates:
        """A new index of the target kind: trained on `train` (n, dim) float32, then filled from
        `batches` of (ids, vectors)."""
        index = new_index(dim, settings)
        inner = _unwrap(index)
        if isinstance(inner, faiss.IndexHNSW):
            inner.hnsw.efConstruction = settings.shape.ef_construction
        if not index.is_trained:
            logger.info("training %s on %d vectors", settings.shape.factory(), len(train))
            fit_projection(index, train)
            index.train(np.ascontiguousarray(train, dtype=np.float32))
        out = cls(dim, settings, index, trained=True)
        with tqdm(total=total, desc=f"FAISS {settings.shape.kind}", unit="frag",
                  disable=total is None or total < 50_000,
                  leave=False) as bar:
            for ids, vecs in batches:
                out.add(ids, vecs)
                bar.update(len(ids))
        return out

    def rebuilt(self, settings: IndexSettings, sources: Sources) -> FaissCandidates:
        """Trains a trainable kind on a random sample of the stored fragments (a flat stand-in while
        there are too few); drops the fragments of removed items that hnsw keeps."""
        dim = self.dim
        if settings.shape.trainable and sources.total < settings.shape.train_threshold():
            out = FaissCandidates(dim, settings)  # the flat stand-in until there is enough to train
            for ids, vecs in sources.batches():
                out.add(ids, vecs)
            return out
        train = sources.sample(train_sample_size(settings)) if settings.shape.trainable else np.zeros((0, dim))
        return FaissCandidates.build(dim, settings, train.astype(np.float32), sources.batches(), total=sources.total)

    # -- persistence ------------------------------------------------------------------------------
    def persist(self, root: Path, generation: int, created: list[Path]) -> dict[str, Any]:
        file, sha = self._file, self._sha
        if self._dirty or not file:
            file = unique_name(FAISS_PREFIX, generation, FAISS_SUFFIX)
            created.append(Path(root) / file)
            with atomic_path(Path(root) / file) as tmp:
                faiss.write_index(self.index, str(tmp))
            sha = sha256_file(Path(root) / file)
        return {"backend": self.NAME, "ann_file": file, "ann_sha256": sha, "ann_trained": self.trained,
                "ann_ntotal": self.ntotal}

    def committed(self, info: dict[str, Any]) -> None:
        self._file, self._sha, self._dirty = str(info["ann_file"]), str(info["ann_sha256"]), False

    def keeps(self) -> set[str]:
        return {self._file}


def new_index(dim: int, settings: IndexSettings) -> faiss.Index:
    """An empty FAISS index of `settings`' kind for dim-d vectors (inner product).

    `pretransform` "PCA<d>" is a projection on d directions fitted at training (see `fit_projection`);
    other pre-transforms go to the FAISS index factory. Raises ValueError when the settings do not
    fit the dimension (e.g. PQ sub-vectors that do not divide it).
    """
    pca = PCA_RE.match(settings.shape.pretransform)
    reduced = int(re.findall(r"\d+", settings.shape.pretransform)[-1]) if settings.shape.pretransform else dim
    if settings.shape.kind == "ivfpq" and reduced % settings.shape.m:
        raise ValueError(f"ivfpq needs m ({settings.shape.m}) to divide the dimension {reduced}: choose another m or a "
                         f"pretransform such as PCA{settings.shape.m * 4}")
    if pca and reduced > dim:
        raise ValueError(f"{settings.shape.pretransform} cannot raise the dimension {dim}")
    factory = settings.shape.factory()
    try:
        if not pca or settings.shape.kind == "flat":
            return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        body = factory.split(",", 2)[-1] if settings.shape.kind == "hnsw" else factory.split(",", 1)[1]
        inner = faiss.index_factory(reduced, body, faiss.METRIC_INNER_PRODUCT)
        projected = faiss.IndexPreTransform(faiss.LinearTransform(dim, reduced, False), inner)
        return faiss.IndexIDMap(projected) if settings.shape.kind == "hnsw" else projected
    except RuntimeError as e:
        raise ValueError(f"cannot make a FAISS {factory!r} index for {dim}-d vectors: {e}") from e


def fit_projection(index: faiss.Index, sample: np.ndarray) -> None:
    """Fit the "PCA<d>" projection of `index` on sample (n, dim): the top-d eigenvectors of the
    uncentred second moment E[x x^T]. No mean is subtracted (FAISS's PCAMatrix subtracts one), so
    inner products are kept up to the discarded directions and the ranking by v . s survives."""
    pre = faiss.downcast_index(index)
    if isinstance(pre, faiss.IndexIDMap):
        pre = faiss.downcast_index(pre.index)
    if not isinstance(pre, faiss.IndexPreTransform):
        return
    lt = faiss.downcast_VectorTransform(pre.chain.at(0))  # type: ignore[attr-defined]
    if not isinstance(lt, faiss.LinearTransform) or isinstance(lt, faiss.PCAMatrix | faiss.OPQMatrix):
        return
    top = uncentred_pca(sample, lt.d_out)
    faiss.copy_array_to_vector(np.ascontiguousarray(top).ravel(), lt.A)
    lt.is_trained = True
    lt.set_is_orthonormal()


def uncentred_pca(sample: np.ndarray, d: int) -> np.ndarray:
    """The top-d eigenvectors (d, dim) float32, largest first, of the uncentred second moment E[x x^T]
    of sample (n, dim): the orthonormal projection that keeps inner products best on d directions."""
    x = np.asarray(sample, dtype=np.float64)
    _, vecs = np.linalg.eigh(x.T @ x / max(1, len(x)))
    return np.ascontiguousarray(vecs[:, ::-1][:, :d].T.astype(np.float32))


def train_sample_size(settings: IndexSettings) -> int:
    """How many vectors to sample for training the target kind."""
    per_list = settings.shape.nlist * TRAIN_SAMPLE_PER_LIST if settings.shape.kind in ("ivf", "ivfpq") else 0
    return min(MAX_TRAIN_SAMPLE, max(settings.shape.train_threshold(), per_list))
