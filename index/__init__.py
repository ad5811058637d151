"""The fragment indexes: FAISS candidate recall over fragment vectors, exact S_kl re-rank.

`ImageIndex` (sentence -> images, phrase -> regions) and `SentenceIndex` (image -> sentences) share
the parts of `fragsearch.index.base` (loading, saving, the ranker); `python -m fragsearch.index.build` builds both
from folders.
"""

from fragsearch.index.files import list_images
from fragsearch.index.images import ImageIndex
from fragsearch.index.sentences import SentenceIndex
from fragsearch.index.types import (
    AddReport,
    Explanation,
    FragmentMatch,
    ImageHit,
    ImageRecord,
    IndexFullError,
    IndexLoadError,
    IndexSettings,
    IndexShape,
    Page,
    PairShare,
    RegionHit,
    SearchSettings,
    SentenceHit,
    SentenceRecord,
)

__all__ = [
    "AddReport",
    "Explanation",
    "FragmentMatch",
    "ImageHit",
    "ImageIndex",
    "ImageRecord",
    "IndexFullError",
    "IndexLoadError",
    "IndexSettings",
    "IndexShape",
    "Page",
    "PairShare",
    "RegionHit",
    "SearchSettings",
    "SentenceHit",
    "SentenceIndex",
    "SentenceRecord",
    "list_images",
]
