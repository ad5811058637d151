"""The FAISS candidate backend: the in-process FAISS index (index.ann), saved as a `faiss-*.index`
file of the index folder at each commit (index.saving), its checksum in the catalogue's `info`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from index.ann import AnnIndex, train_sample_size
from index.candidates import CandidateBackend, Sources
from index.files import sha256_file, unique_name
from index.types import IndexLoadError, IndexSettings
from model.atomic import atomic_path

FAISS_PREFIX, FAISS_SUFFIX = "faiss", ".index"


class FaissCandidates(CandidateBackend):
    """The in-process FAISS index (index.ann), saved as a file of the index folder."""

    NAME = "faiss"

    def __init__(self, ann: AnnIndex, file: str = "", sha: str = "") -> None:
        self.ann = ann
        self.settings = ann.settings
        self._file, self._sha = file, sha
        self._dirty = not file

    @classmethod
    def create(cls, dim: int, settings: IndexSettings) -> FaissCandidates:
        return cls(AnnIndex(dim, settings))

    @classmethod
    def open(cls, root: Path, dim: int, settings: IndexSettings, info: dict[str, Any]) -> FaissCandidates:
        where = f"index at {root}"
        file = str(info.get("ann_file", ""))
        path = Path(root) / file
        if not file or not path.is_file():
            raise IndexLoadError(f"{where}: FAISS file {file or '(none)'} is missing")
        if sha256_file(path) != info.get("ann_sha256"):
            raise IndexLoadError(f"{where}: FAISS file {file} is corrupt (checksum mismatch)")
        try:
            ann = AnnIndex.read(path, dim, settings, bool(info["ann_trained"]))
        except (RuntimeError, ValueError) as e:
            raise IndexLoadError(f"{where}: FAISS file {file} is unreadable: {e}") from e
        if ann.ntotal != int(info["ann_ntotal"]):
            raise IndexLoadError(f"{where}: FAISS file holds {ann.ntotal} fragments, metadata says "
                                 f"{info['ann_ntotal']}")
        return cls(ann, file, str(info["ann_sha256"]))

    # -- state ------------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return self.ann.ntotal

    @property
    def active_kind(self) -> str:
        return self.ann.active_kind

    @property
    def trained(self) -> bool:
        return self.ann.trained

    @property
    def supports_remove(self) -> bool:
        return self.ann.supports_remove

    def needs_build(self, n_vectors: int) -> bool:
        return self.ann.needs_build(n_vectors)

    def set_settings(self, settings: IndexSettings) -> None:
        self.settings = settings
        self.ann.set_settings(settings)

    # -- writes -----------------------------------------------------------------------------------
    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        if len(ids):
            self.ann.add(ids, vecs)
            self._dirty = True

    def remove_item(self, item: int) -> int:
        n = self.ann.remove_item(item)
        self._dirty |= n > 0
        return n

    def remove_ids(self, ids: np.ndarray) -> int:
        n = self.ann.remove_ids(ids)
        self._dirty |= n > 0
        return n

    def rebuilt(self, settings: IndexSettings, sources: Sources) -> FaissCandidates:
        """Trains a trainable kind on a random sample of the stored fragments (a flat stand-in while
        there are too few); drops the fragments of removed items that hnsw keeps."""
        dim = self.ann.dim
        if settings.trainable and sources.total < settings.train_threshold():
            ann = AnnIndex(dim, settings)  # the flat stand-in until there is enough to train
            for ids, vecs in sources.batches():
                ann.add(ids, vecs)
        else:
            train = sources.sample(train_sample_size(settings)) if settings.trainable else np.zeros((0, dim))
            ann = AnnIndex.build(dim, settings, train.astype(np.float32), sources.batches(), total=sources.total)
        return FaissCandidates(ann)

    # -- search -----------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.ann.search(queries, k)  # `items` is filtered by the caller

    def search_positive(self, queries: np.ndarray, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.ann.search_positive(queries)

    def policy(self) -> dict[str, str]:
        return self.ann.policy()

    # -- persistence ------------------------------------------------------------------------------
    def persist(self, root: Path, generation: int, created: list[Path]) -> dict[str, Any]:
        file, sha = self._file, self._sha
        if self._dirty or not file:
            file = unique_name(FAISS_PREFIX, generation, FAISS_SUFFIX)
            created.append(Path(root) / file)
            with atomic_path(Path(root) / file) as tmp:
                self.ann.write(tmp)
            sha = sha256_file(Path(root) / file)
        return {"backend": self.NAME, "ann_file": file, "ann_sha256": sha, "ann_trained": self.ann.trained,
                "ann_ntotal": self.ann.ntotal}

    def committed(self, info: dict[str, Any]) -> None:
        self._file, self._sha, self._dirty = str(info["ann_file"]), str(info["ann_sha256"]), False

    def keeps(self) -> set[str]:
        return {self._file}
