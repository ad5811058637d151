"""Opening a saved index: a snapshot of its catalogue, every check that the folder is whole and was
built for this model, the store segments and the candidate backend its committed `info` names.

A load reads one committed state (index.saving): the catalogue snapshot pins the `info` row, and the
files it names are opened while the snapshot is held. A writer in another process may commit and
delete those files meanwhile; the load then starts again on the newer state (`LOAD_ATTEMPTS`).
Anything missing, corrupt or inconsistent is an IndexLoadError that says what and where.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fragsearch.index.backends import open_backend
from fragsearch.index.candidates import CandidateBackend
from fragsearch.index.catalogue import FORMAT, Catalogue, committed_generation
from fragsearch.index.codes import CodesInfo, PrescoreCodes
from fragsearch.index.fingerprint import model_fingerprint
from fragsearch.index.store import VectorStore
from fragsearch.index.types import BackendOptions, IndexLoadError, IndexSettings
from fragsearch.model.bundle import Bundle

logger = logging.getLogger(__name__)

LOAD_ATTEMPTS = 5  # loads of an index that a writer keeps committing to meanwhile

T = TypeVar("T")


class IndexMovedError(IndexLoadError):
    """The index was committed anew while it was being loaded (the files a snapshot named are gone)."""


@dataclass
class Opened:
    """One committed state, checked: what an index is made of."""

    root: Path
    catalogue: Catalogue
    settings: IndexSettings
    store: VectorStore
    rows: np.ndarray  # the catalogue's item rows: id, segment, offset, fragments, removed
    next_id: int
    generation: int
    candidates: CandidateBackend
    codes: PrescoreCodes | None


def load(root: Path, bundle: Bundle, kind: str, columns: tuple[tuple[str, str], ...],
         search: dict[str, Any] | None, backend: BackendOptions | None, build: Callable[[Opened], T]) -> T:
    """`build(opened)` of the committed state of the index of `kind` at `root`; loaded again when a
    writer committed and removed files the first snapshot named. `build` may raise IndexLoadError
    for what it checks itself."""
    for attempt in range(LOAD_ATTEMPTS):
        try:
            return _load_once(Path(root), bundle, kind, columns, search or {}, backend, build)
        except IndexMovedError:
            if attempt == LOAD_ATTEMPTS - 1:
                raise
            logger.info("index at %s changed while it was being loaded: loading it again", root)
    raise AssertionError("unreachable")


def _load_once(root: Path, bundle: Bundle, kind: str, columns: tuple[tuple[str, str], ...],
               search: dict[str, Any], backend: BackendOptions | None, build: Callable[[Opened], T]) -> T:
    catalogue, info = Catalogue.open_snapshot(root, columns, kind)
    try:
        built = build(open_state(root, bundle, kind, catalogue, info, search, backend))
        catalogue.end_snapshot()
    except IndexLoadError as e:
        catalogue.close()
        if committed_generation(root) != info.get("generation"):  # a newer commit replaced the files it named
            raise IndexMovedError(str(e)) from e
        raise
    except BaseException:
        catalogue.close()
        raise
    return built


def open_state(root: Path, bundle: Bundle, kind: str, catalogue: Catalogue, info: dict[str, Any],
               search: dict[str, Any], backend: BackendOptions | None) -> Opened:
    """Check the committed `info` against the model and the folder, and open what it names."""
    where = f"index at {root}"
    if info.get("format") != FORMAT:
        raise IndexLoadError(f"{where} has format {info.get('format')!r}, expected {FORMAT!r}")
    if info.get("kind") != kind:
        raise IndexLoadError(f"{where} is an index of {info.get('kind')}s, not of {kind}s")
    if int(info["dim"]) != bundle.dim:
        raise IndexLoadError(f"{where} holds {info['dim']}-d fragments but the model embeds in {bundle.dim}-d: "
                             f"it was built with another model; rebuild it with python -m fragsearch.index.build")
    if info["fingerprint"] != model_fingerprint(bundle):
        raise IndexLoadError(f"{where} was built with another model (fingerprint {info['fingerprint']}, this "
                             f"model {model_fingerprint(bundle)}); rebuild it with python -m fragsearch.index.build")
    try:
        settings = IndexSettings.from_dict(info["settings"])
        if search:
            settings = settings.with_search(**search)
    except (TypeError, ValueError) as e:
        raise IndexLoadError(f"{where}: bad settings: {e}") from e
    store = VectorStore(bundle.dim, settings.shape.store_dtype, root)
    files, arrays = [], []
    for seg in info["segments"]:
        file, n_rows = str(seg["file"]), int(seg["rows"])
        try:
            arrays.append(VectorStore.open_segment(root / file, bundle.dim, store.dtype, n_rows))
        except FileNotFoundError as e:
            raise IndexLoadError(f"{where}: store file {file} is missing") from e
        except (OSError, ValueError) as e:
            raise IndexLoadError(f"{where}: store file {file} is corrupt: {e}") from e
        files.append(file)
    store.commit(files, arrays)
    rows = catalogue.item_rows()
    next_id = int(info["next_id"])
    if len(rows):
        if rows[:, 0].max() >= next_id:
            raise IndexLoadError(f"{where}: item ids beyond next_id {next_id}: inconsistent metadata")
        live = rows[rows[:, 1] >= 0]
        sizes = np.array(store.segment_rows() + [0], dtype=np.int64)
        if len(live) and ((live[:, 1] >= len(arrays)).any() or (live[:, 2] + live[:, 3] > sizes[live[:, 1]]).any()):
            raise IndexLoadError(f"{where}: item rows point outside the store: inconsistent metadata")
        if (rows[rows[:, 4] == 0, 1] < 0).any():
            raise IndexLoadError(f"{where}: a live item has no stored vectors: inconsistent metadata")
    codes = None
    if info.get("codes"):
        try:
            codes = PrescoreCodes.open(root, CodesInfo.from_dict(info["codes"]), bundle.dim, store.segment_rows())
        except FileNotFoundError as e:
            raise IndexLoadError(f"{where}: prescore code file {e.filename} is missing") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise IndexLoadError(f"{where}: prescore codes are corrupt: {e}") from e
    candidates = open_backend(root, bundle.dim, settings, info, backend)
    return Opened(root, catalogue, settings, store, rows, next_id, int(info["generation"]), candidates, codes)
