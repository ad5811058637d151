"""The candidate backend an index uses: a new one for a new folder, or the one its committed `info`
names (index.ann, index.milvus; pymilvus is imported only by indexes that use Milvus)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fragsearch.index.ann import FaissCandidates
from fragsearch.index.candidates import CandidateBackend
from fragsearch.index.milvus import MilvusCandidates
from fragsearch.index.types import BackendOptions, IndexLoadError, IndexSettings


def require_milvus(where: str) -> None:
    """ImportError naming the extra to install when pymilvus is not installed (`pip install .` alone)."""
    if importlib.util.find_spec("pymilvus") is None:
        raise ImportError(f"{where} needs the Milvus client, which this installation lacks: install the "
                          "project with its milvus extra (pip install 'fragsearch[milvus]', or '.[milvus]' "
                          "from a checkout)")


def create_backend(root: Path, dim: int, settings: IndexSettings, options: BackendOptions,
                   kind: str) -> CandidateBackend:
    """An empty backend for a new index folder."""
    if options.backend == "milvus":
        require_milvus(f"the index at {root} (backend milvus)")
        return MilvusCandidates.create(root, dim, settings, options, kind)
    return FaissCandidates.create(dim, settings)


def open_backend(root: Path, dim: int, settings: IndexSettings, info: dict[str, Any],
                 options: BackendOptions | None) -> CandidateBackend:
    """The backend an index folder's committed `info` names (IndexLoadError when it cannot be opened,
    or when `options` ask for another backend than the index was built with)."""
    name = str(info.get("backend", "faiss"))
    if options is not None and options.backend != name:
        raise IndexLoadError(f"the index at {root} keeps its candidates in {name}, not {options.backend}: "
                             f"build it anew with --backend {options.backend}")
    if name == "milvus":
        require_milvus(f"the index at {root}, whose candidates are in Milvus,")
        return MilvusCandidates.open(root, dim, settings, info, options)
    if name != "faiss":
        raise IndexLoadError(f"the index at {root} names an unknown candidate backend {name!r}")
    return FaissCandidates.open(root, dim, settings, info, mapped=options is not None and options.mapped)
