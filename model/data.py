"""A data folder laid out like Flickr8K: `images/`, `captions.txt`, split lists.

`captions.txt` lines are `<image>#<n>\t<caption>`; a split list names one image file per line.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """The data folder, a caption file or a split list is missing or malformed."""


@dataclass(frozen=True)
class Split:
    """Images of one split and their captions, in file order.

    `images[k]` has captions `captions[k]` (usually 5); `pairs()` flattens them.
    """

    root: Path
    images: tuple[str, ...]
    captions: tuple[tuple[str, ...], ...]

    def image_path(self, name: str) -> Path:
        return self.root / "images" / name

    def pairs(self) -> list[tuple[int, str]]:
        """(image index, caption) for every caption of the split."""
        return [(k, c) for k, caps in enumerate(self.captions) for c in caps]

    def sentences(self) -> tuple[list[str], list[int]]:
        """All captions flat, and for each the index of its image."""
        pairs = self.pairs()
        return [c for _, c in pairs], [k for k, _ in pairs]

    def subset(self, n: int) -> Split:
        return Split(self.root, self.images[:n], self.captions[:n])


def check_data_dir(root: Path) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data folder not found: {root} (expected images/, captions.txt and split lists)")
    if not (root / "images").is_dir():
        raise DataError(f"no images/ folder in {root}")
    if not (root / "captions.txt").is_file():
        raise DataError(f"no captions.txt in {root}")
    return root


def read_captions(path: Path) -> dict[str, list[str]]:
    """image file name -> its captions in the order of their `#n` suffix; empty captions are skipped."""
    by_image: dict[str, list[tuple[int, str]]] = defaultdict(list)
    empty = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if "\t" not in line:
                raise DataError(f"{path}:{lineno}: expected '<image>#<n>\\t<caption>'")
            key, caption = line.split("\t", 1)
            name, _, num = key.partition("#")
            if not caption.strip():
                empty += 1
                continue
            by_image[name].append((int(num) if num.isdigit() else len(by_image[name]), caption.strip()))
    if empty:
        logger.warning("%s: %d empty captions skipped", path, empty)
    return {k: [c for _, c in sorted(v)] for k, v in by_image.items()}


def read_split_list(path: Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"split list not found: {path}")
    names = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not names:
        raise DataError(f"split list is empty: {path}")
    return names


def load_split(root: Path, split: str | Path) -> Split:
    """A split by name ("train" -> root/train.txt) or by the path of its list.

    Images without captions or missing on disk are dropped with a warning.
    """
    root = check_data_dir(root)
    split_path = Path(split)
    if not split_path.suffix and not split_path.exists():
        split_path = root / f"{split}.txt"
    names = read_split_list(split_path)
    captions = read_captions(root / "captions.txt")
    images: list[str] = []
    caps: list[tuple[str, ...]] = []
    missing = 0
    for name in names:
        if name not in captions or not (root / "images" / name).is_file():
            missing += 1
            continue
        images.append(name)
        caps.append(tuple(captions[name]))
    if missing:
        logger.warning("%s: %d listed images have no captions or no file; dropped", split_path, missing)
    if not images:
        raise DataError(f"no usable image in {split_path}")
    return Split(root, tuple(images), tuple(caps))
