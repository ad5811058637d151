"""Flickr30k Entities for the Flickr8K images: which phrase of which caption names which box.

Read from the release's own files (``Sentences/<id>.txt``: five captions, each annotated phrase in brackets,
``[/EN#<chain>/<type>[/<type>...] <words>]``; ``Annotations/<id>.xml``: the original image's size and the
boxes of each chain, PASCAL VOC style, 1-based pixels), straight from the archive in the ``entities`` data
folder (default ``../shared/data/flickr30k-entities``), or from an unpacked ``Flickr30kEntities`` folder.

A Flickr8K caption is matched to its Entities line: equal once lowercased and stripped of punctuation (about
97 %), else the most alike line at a difflib ratio of at least ``MATCH_RATIO``. A chain's boxes are given in
the pixels of the Flickr8K copy, which is the original squashed to its size: x -> (x - 1) * width / W.
One reader for every use of the annotations (the grounding measure, phrase evidence labels).
"""

from __future__ import annotations

import difflib
import re
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ARCHIVE = "flickr30k-entities-flickr8k-train-dev.tar.gz"
FOLDER = "Flickr30kEntities"
MATCH_RATIO = 0.9  # the least difflib ratio at which a caption that is not equal is taken as its line
NOT_VISUAL = "notvisual"  # the type of chain 0: never boxed
_PHRASE = re.compile(r"\[/EN#(\d+)/(\S+) ([^\]]*)\]")
_NORMAL = re.compile(r"[^a-z0-9 ]+")


class EntitiesError(ValueError):
    """The Entities annotations cannot be read (no archive or folder, a damaged file)."""


@dataclass(frozen=True)
class Phrase:
    """An annotated phrase of a caption: its chain id, entity types, and its words (lower case), which
    stand at word positions ``start`` to ``start + len(words)`` of the caption's words."""

    chain: str
    types: tuple[str, ...]
    words: tuple[str, ...]
    start: int

    @property
    def head(self) -> str:
        """The phrase's head noun, taken as its last word (English noun phrases end in their head, mostly)."""
        return self.words[-1] if self.words else ""

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(frozen=True)
class Caption:
    """One Entities caption: its words (lower case, brackets removed, punctuation kept as words) and phrases."""

    words: tuple[str, ...]
    phrases: tuple[Phrase, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass
class ImageEntities:
    """The annotations of one image: the original's size, its five captions, each chain's boxes (K, 4) float32
    in the original's 0-based pixels, and the chains marked as the scene or as having no box."""

    image_id: str
    width: int
    height: int
    captions: list[Caption]
    boxes: dict[str, np.ndarray] = field(default_factory=dict)
    scene: set[str] = field(default_factory=set)
    no_box: set[str] = field(default_factory=set)

    def boxes_at(self, chain: str, width: int, height: int) -> np.ndarray:
        """Chain ``chain``'s boxes (K, 4) in a copy of the image squashed to width x height (empty: none)."""
        b = self.boxes.get(chain)
        if b is None or not len(b):
            return np.zeros((0, 4), np.float32)
        scale = np.asarray([width / self.width, height / self.height] * 2, np.float32)
        return np.clip(b * scale, 0, np.asarray([width, height, width, height], np.float32)).astype(np.float32)

    def boxed(self, caption: Caption) -> list[Phrase]:
        """The phrases of one of its captions that name something with a box in the image."""
        return [p for p in caption.phrases
                if p.chain != "0" and NOT_VISUAL not in p.types and p.chain in self.boxes and p.words]

    def match(self, caption: str) -> Caption | None:
        """The Entities caption a Flickr8K caption is (see the module's note), None where none is alike."""
        want = normalise(caption)
        lines = [normalise(c.text) for c in self.captions]
        for c, line in zip(self.captions, lines, strict=True):
            if line == want:
                return c
        ratios = [difflib.SequenceMatcher(None, want, line).ratio() for line in lines]
        best = int(np.argmax(ratios)) if ratios else -1
        return self.captions[best] if best >= 0 and ratios[best] >= MATCH_RATIO else None


def normalise(text: str) -> str:
    """Lower case, punctuation removed, spaces folded: how a Flickr8K caption and its Entities line compare."""
    return " ".join(_NORMAL.sub(" ", text.lower()).split())


def image_id(name: str) -> str:
    """A Flickr8K file name's Flickr30K id: ``1000268201_693b08cb0e.jpg`` -> ``1000268201``; another name's
    stem (``shape_0001.jpg`` -> ``shape_0001``)."""
    stem = Path(name).stem
    head = stem.split("_")[0]
    return head if head.isdigit() else stem


def parse_caption(line: str) -> Caption:
    """One line of ``Sentences/<id>.txt`` -> its words and phrases."""
    words: list[str] = []
    phrases: list[Phrase] = []
    pos = 0
    for m in _PHRASE.finditer(line):
        words += line[pos : m.start()].lower().split()
        inner = tuple(m.group(3).lower().split())
        phrases.append(Phrase(m.group(1), tuple(m.group(2).split("/")), inner, len(words)))
        words += inner
        pos = m.end()
    words += line[pos:].lower().split()
    return Caption(tuple(words), tuple(phrases))


def parse_annotation(text: str | bytes, image: str) -> ImageEntities:
    """One ``Annotations/<id>.xml`` -> the image's size and each chain's boxes (captions not filled)."""
    try:
        root = ET.fromstring(text)
        size = root.find("size")
        if size is None:
            raise EntitiesError(f"{image}: the annotation has no size")
        width, height = int(size.findtext("width", "0")), int(size.findtext("height", "0"))
    except (ET.ParseError, ValueError) as e:
        raise EntitiesError(f"{image}: unreadable annotation ({e})") from e
    if width < 1 or height < 1:
        raise EntitiesError(f"{image}: the annotation's size is {width}x{height}")
    out = ImageEntities(image, width, height, [])
    found: dict[str, list[list[float]]] = {}
    for obj in root.iter("object"):
        chains = [n.text.strip() for n in obj.findall("name") if n.text]
        box = obj.find("bndbox")
        if box is not None:
            x0, y0, x1, y1 = (float(box.findtext(k, "0")) for k in ("xmin", "ymin", "xmax", "ymax"))
            for c in chains:
                found.setdefault(c, []).append([x0 - 1, y0 - 1, x1 - 1, y1 - 1])
        if obj.findtext("scene", "0").strip() == "1":
            out.scene.update(chains)
        if obj.findtext("nobndbox", "0").strip() == "1":
            out.no_box.update(chains)
    out.boxes = {c: np.asarray(b, np.float32).reshape(-1, 4) for c, b in found.items()}
    return out


def _files(root: Path) -> Iterator[tuple[str, bytes]]:
    """(member path inside the release, bytes) of every annotation file under `root`: its archive, or an
    unpacked Flickr30kEntities folder."""
    archive = root / ARCHIVE if root.is_dir() else root
    if archive.is_file():
        try:
            with tarfile.open(archive) as tar:
                for member in tar:
                    if member.isfile():
                        fh = tar.extractfile(member)
                        if fh is not None:
                            yield member.name, fh.read()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise EntitiesError(f"{archive}: unreadable archive ({e})") from e
        return
    folder = root / FOLDER if (root / FOLDER).is_dir() else root
    if not (folder / "Sentences").is_dir():
        raise EntitiesError(f"{root}: neither {ARCHIVE} nor a {FOLDER} folder with Sentences/ and Annotations/")
    for sub in ("Sentences", "Annotations"):
        for path in sorted((folder / sub).iterdir()):
            yield f"{FOLDER}/{sub}/{path.name}", path.read_bytes()


def read_entities(root: Path, images: Iterable[str] | None = None) -> dict[str, ImageEntities]:
    """The annotations of the Flickr8K images `images` (file names; all there are when None), keyed by file
    name (by Flickr30K id when `images` is None). An image with sentences but no annotation file, or the
    reverse, is left out."""
    wanted = None if images is None else {image_id(n): n for n in images}
    sentences: dict[str, list[Caption]] = {}
    annotations: dict[str, ImageEntities] = {}
    for member, data in _files(Path(root)):
        parts = member.split("/")
        if len(parts) < 2:
            continue
        kind, stem = parts[-2], Path(parts[-1]).stem
        if wanted is not None and stem not in wanted:
            continue
        if kind == "Sentences":
            text = data.decode("utf-8", errors="replace")
            sentences[stem] = [parse_caption(line) for line in text.splitlines() if line.strip()]
        elif kind == "Annotations":
            annotations[stem] = parse_annotation(data, stem)
    out: dict[str, ImageEntities] = {}
    for stem, ann in annotations.items():
        if stem in sentences:
            ann.captions = sentences[stem]
            out[wanted[stem] if wanted is not None else stem] = ann
    return out
