"""Cut-point activations: every region crop of a split's images run once through the float backbone up
to a cut point (the stem and the first ``cut`` MBConv blocks), stored as one float16 memmap, so that the
layers above the cut can be fine-tuned with the fragment objective in minutes per epoch.

    nice -n 10 python -m fragsearch.training.cutpoint --variant full --splits train dev \
        --out artifacts/cache/cut/full-b16

The regions are the cached ones of the variant's feature cache (its boxes: the proposals are kept and
ranked by the ImageNet head, as in serving). Each crop is warped to ``crop_size``² exactly as
``fragsearch.model.image.region_crops`` does for serving. The store is resumable: ``done.npy`` marks the images
written, flushed every few images; a re-run does the rest.

Folder layout: ``meta.json`` (image names in order, the cut, the activation shape, the fragments per
image), ``acts.f16`` (N, F, C, h, w) float16, ``done.npy`` (N,) bool.

Its command line: fragsearch/commands/cutpoint.py (`python -m fragsearch.training.cutpoint` calls it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fragsearch.model.atomic import atomic_file
from fragsearch.model.config import ImageConfig
from fragsearch.model.data import check_data_dir, load_split
from fragsearch.model.dataset import feature_cache, held_out_indices
from fragsearch.model.features import read_entry
from fragsearch.model.image import region_crops
from fragsearch.model.imageio import load_image
from fragsearch.model.onnx import session, set_threads
from fragsearch.training.nets.backbone import Trunk, cut_shape, efficientnet
from fragsearch.training.nets.onnx import export

logger = logging.getLogger(__name__)

DEFAULT_CUT = 16  # after every MBConv block: the head convolution (and its batch norm) is what is fine-tuned
FLUSH_EVERY = 25  # images between flushes of the memmap and the done marks


@dataclass
class CutStore:
    """A folder of cut-point activations (see the module doc)."""

    folder: Path
    names: list[str]
    cut: int
    shape: tuple[int, int, int]
    n_fragments: int

    @property
    def acts_path(self) -> Path:
        return self.folder / "acts.f16"

    @property
    def done_path(self) -> Path:
        return self.folder / "done.npy"

    @classmethod
    def create(cls, folder: Path, names: Sequence[str], cut: int, shape: tuple[int, int, int],
               n_fragments: int) -> CutStore:
        """Open the store in ``folder``, made with these settings if missing; ValueError if the folder
        holds a store made with others."""
        folder.mkdir(parents=True, exist_ok=True)
        store = cls(folder, list(names), cut, tuple(shape), n_fragments)  # type: ignore[arg-type]
        meta = folder / "meta.json"
        if meta.is_file():
            old = cls.open(folder)
            if (old.names, old.cut, old.shape, old.n_fragments) != (store.names, cut, store.shape, n_fragments):
                raise ValueError(f"{folder} holds cut-point activations made with other settings")
            return old
        with atomic_file(meta) as fh:
            fh.write(json.dumps({"names": store.names, "cut": cut, "shape": list(shape),
                                 "n_fragments": n_fragments}).encode())
        np.memmap(store.acts_path, np.float16, "w+", shape=store.full_shape).flush()
        np.save(store.done_path, np.zeros(len(names), dtype=bool))
        return store

    @classmethod
    def open(cls, folder: Path) -> CutStore:
        meta = json.loads((folder / "meta.json").read_text())
        return cls(folder, list(meta["names"]), int(meta["cut"]), tuple(meta["shape"]), int(meta["n_fragments"]))

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (len(self.names), self.n_fragments, *self.shape)

    def acts(self, mode: str = "r") -> np.memmap:
        """(N, F, C, h, w) float16 activations (``mode`` "r" or "r+")."""
        return np.memmap(self.acts_path, np.float16, mode, shape=self.full_shape)  # type: ignore[call-overload]

    def done(self) -> np.ndarray:
        return np.load(self.done_path)

    def rows(self, names: Sequence[str]) -> np.ndarray:
        """Row index of each image name; KeyError if one is missing or not written yet."""
        index = {n: k for k, n in enumerate(self.names)}
        done = self.done()
        rows = np.asarray([index[n] for n in names], dtype=np.int64)
        missing = [names[int(i)] for i in np.flatnonzero(~done[rows])]
        if missing:
            raise KeyError(f"{len(missing)} images have no cut-point activations yet in {self.folder}, "
                           f"e.g. {missing[0]}")
        return rows


def trunk_session(folder: Path, cut: int, threads: int) -> object:
    """The float trunk (stem + blocks[:cut]) as an ONNX Runtime session (exported into ``folder`` once)."""
    path = export(Trunk(efficientnet(), cut), (torch.zeros(1, 3, 224, 224),), folder / f"trunk-cut{cut}-fp32.onnx",
                  ["x"], ["acts"], {"x": {0: "batch"}, "acts": {0: "batch"}})
    return session(path, "cpu", threads)


def extract(data_root: Path, splits: Sequence[str], image_cfg: ImageConfig, cache_root: Path, out: Path,
            cut: int = DEFAULT_CUT, threads: int = 1, progress: bool = True, val_images: int = 0,
            val_seed: int = 0, order_seed: int | None = None) -> CutStore:
    """Write the cut-point activations of every region crop of the ``splits``' images into ``out``
    (resuming what an earlier run left); the regions are the feature cache's boxes for ``image_cfg``.

    Order: the first split's validation part first (``val_images`` drawn with ``val_seed``, as
    ``--selection val`` holds them out), then with ``order_seed`` the rest of the first split in a
    seeded random order (so a store stopped early holds a random subset of it), then the other splits."""
    set_threads(threads)
    root = check_data_dir(data_root)
    paths: dict[str, Path] = {}
    first = 0
    for split in splits:
        sp = load_split(root, split)
        paths.update({n: sp.image_path(n) for n in sp.images})
        first = first or len(paths)
    cache = feature_cache(cache_root, image_cfg)
    store = CutStore.create(out, list(paths), cut, cut_shape(cut, image_cfg.crop_size), image_cfg.n_fragments)
    done = store.done()
    order = np.arange(len(store.names))
    if order_seed is not None:
        order[:first] = np.random.default_rng(order_seed).permutation(first)
    if val_images:
        val = held_out_indices(first, val_images, val_seed)
        order = np.concatenate([val, order[~np.isin(order, val)]])
    todo = order[~done[order]]
    if not len(todo):
        return store
    sess: object = trunk_session(out, cut, threads)
    acts = store.acts("r+")
    bar = tqdm(total=len(store.names), initial=int(done.sum()), desc="cut-point activations", unit="img",
               disable=not progress, smoothing=0.05)
    try:
        for n, k in enumerate(todo):
            name = store.names[k]
            entry = read_entry(cache.path(paths[name]))
            img = load_image(paths[name].read_bytes(), name=name)
            crops = region_crops(img.convert("RGB"), entry.boxes, image_cfg.crop_size)
            acts[k] = sess.run(None, {"x": crops})[0].astype(np.float16)  # type: ignore[attr-defined]
            done[k] = True
            bar.update(1)
            if (n + 1) % FLUSH_EVERY == 0 or n + 1 == len(todo):
                acts.flush()  # the activations before the marks: a mark never covers unwritten rows
                with atomic_file(store.done_path) as fh:
                    np.save(fh, done)
    finally:
        bar.close()
    return store


if __name__ == "__main__":  # `python -m fragsearch.training.cutpoint`, as the docs write it: the command's alias
    from fragsearch.commands.cutpoint import main

    main()
