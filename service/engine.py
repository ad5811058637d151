"""The loaded model and indexes behind the routes: reads are shared, writes are serialised.

Every method here is blocking CPU work; the routes call them through a threadpool, behind the
service's gates (service/admission.py: the one bound on heavy work and on searches). A read makes one
call into an index, which makes its query fragments itself (model/embed.py). What the model finds
wrong with an input (an image it cannot decode, a query with no usable fragment) becomes an ApiError
by its type; the request's shape and bounds were checked before (service/schemas.py, service/deps.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from fragsearch.index import Explanation, ImageHit, ImageIndex, ImageRecord, Page, RegionHit, SentenceHit, SentenceIndex
from fragsearch.index.ann import gpu_available
from fragsearch.index.catalogue import is_index
from fragsearch.index.duplicates import Duplicate, duplicates_of
from fragsearch.index.places import PlaceFilter
from fragsearch.index.similar import Similar, similar_to_image, similar_to_indexed
from fragsearch.index.sync import SyncReport, sync_folder
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Relevance
from fragsearch.model.dataset import feature_cache
from fragsearch.model.device import is_gpu
from fragsearch.model.features import PhotoReader
from fragsearch.model.fragments import NoFragmentsError
from fragsearch.model.imageio import ImageReadError, ImageTooLargeError, NotAnImageError, Photo
from fragsearch.service.errors import ApiError
from fragsearch.service.thumbnails import thumbnail
from fragsearch.settings import Settings

logger = logging.getLogger(__name__)

UPLOAD_FORMAT = "JPEG"
UPLOAD_QUALITY = 95
MAX_NAME_CHARS = 100
WARMUP_SENTENCE = "a dog runs on the grass"
WARMUP_SIDE = 224


def image_error(exc: ImageReadError) -> ApiError:
    """Map an unreadable upload to the contract by its type: too large 413, not an image 415, damaged 422."""
    if isinstance(exc, ImageTooLargeError):
        return ApiError(413, "image_too_large", f"the image is too large: {exc}")
    if isinstance(exc, NotAnImageError):
        return ApiError(415, "not_an_image", "the upload is not an image (JPEG, PNG, GIF, BMP, WebP, ...)")
    return ApiError(422, "bad_image", f"the image cannot be decoded (truncated or corrupt): {exc}")


@contextlib.contextmanager
def matched_as(what: str) -> Iterator[None]:
    """The one answer to a query the model finds nothing to match in (a NoFragmentsError raised in the block): 422
    naming `what` it was. Blank text never gets here: the schemas refuse it."""
    try:
        yield
    except NoFragmentsError as e:
        raise ApiError(422, "no_fragments", f"the {what} has no usable fragment: {e}") from e


def storage_error(exc: OSError, what: str) -> ApiError | None:
    """A full disk (or quota) while saving -> 507 with what survived; None for any other OSError."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return ApiError(507, "insufficient_storage", f"no space left to save the index: {what}")


def safe_name(filename: str | None, fallback: str) -> str:
    """A display name from an upload's file name: its last path part, tame characters only."""
    base = re.split(r"[\\/]", filename or "")[-1]
    base = re.sub(r"[^A-Za-z0-9._ -]", "_", base).strip(" .")[:MAX_NAME_CHARS]
    return base or fallback


Side = Literal["images", "sentences"]  # what a query ranks: images for a sentence, sentences for an image
QUERY_KIND: dict[Side, str] = {"images": "search", "sentences": "annotate"}  # the relevance scale's name of each


def relevance_at(bundle: Bundle, side: Side, best: np.ndarray, items: int) -> Relevance | None:
    """The model's relevance scale for one query: a search of the images for a sentence ('images') or of the
    sentences for an image ('sentences') in a collection of `items` items, whose ranking's best scores are
    `best` (Page.best and Page.collection: the results are compared with the rest of the collection); None:
    the model has none."""
    rel = bundle.relevance
    if rel is None:
        return None
    return rel.for_query(QUERY_KIND[side], best, items)


class Engine:
    """Model + image index + sentence index, loaded once and shared by all requests."""

    def __init__(self, settings: Settings, bundle: Bundle, images: ImageIndex,
                 sentences: SentenceIndex | None, load_seconds: float = 0.0) -> None:
        self.settings = settings
        self.bundle = bundle
        self.images = images
        self.sentences = sentences
        self.load_seconds = load_seconds
        self.reader = PhotoReader.of(bundle.image_cfg, settings.max_pixels)  # uploads, as the model reads them
        self._write_lock = threading.Lock()

    @classmethod
    def load(cls, settings: Settings, with_sentences: bool = True) -> Engine:
        """Load the checkpoint and both indexes named by the settings (raises on a missing or bad one).

        Image paths are read against the data folder (index/images.py); FAISS searches on the GPU when
        the model is on one. `with_sentences=False` leaves the sentence index for `attach_sentences`."""
        t0 = time.perf_counter()
        bundle = Bundle.load(settings.model_path, device=settings.device, places=settings.places)
        # a served folder keeps its feature cache: renamed files come back from it at every sync
        cache = (feature_cache(settings.cache, bundle.image_cfg, artifacts=settings.artifacts)
                 if settings.mode == "collection" else None)
        images = ImageIndex.load(settings.image_index, bundle, cache=cache, collection_root=settings.collection_root,
                                 backend=settings.backend, use_gpu=is_gpu(bundle.device))
        sentences = cls._sentence_index(settings, bundle) if with_sentences else None
        if sentences is None and with_sentences:
            logger.warning("no sentence index at %s: /annotate is unavailable", settings.sentence_index)
        engine = cls(settings, bundle, images, sentences)
        engine.load_seconds = time.perf_counter() - t0
        logger.info("loaded model and indexes in %.1fs: %d images, %d sentences", engine.load_seconds,
                    len(images), engine.sentence_count())
        engine.log_device_policy()
        return engine

    def log_device_policy(self) -> None:
        """Where the model and each index call run (model.device.placement), once at start."""
        indexes = [i for i in (self.images, self.sentences) if i is not None]
        logger.info("device policy: model on %s; %s", self.bundle.device, "; ".join(i.device_policy() for i in indexes))
        if is_gpu(self.bundle.device) and not gpu_available() and any(i.candidates.NAME == "faiss" for i in indexes):
            logger.warning("the model is on %s but faiss has no GPU here (faiss-cpu, or no GPU it sees): FAISS "
                           "searches on the CPU", self.bundle.device)

    @staticmethod
    def _sentence_index(settings: Settings, bundle: Bundle) -> SentenceIndex | None:
        if not is_index(settings.sentence_index):
            return None
        return SentenceIndex.load(settings.sentence_index, bundle, backend=settings.backend,
                                  use_gpu=is_gpu(bundle.device))

    def attach_sentences(self) -> bool:
        """Load the sentence index (built after the engine was loaded); False when there is none."""
        self.sentences = self._sentence_index(self.settings, self.bundle)
        return self.sentences is not None

    def sentence_count(self) -> int:
        return len(self.sentences) if self.sentences is not None else 0

    def relevance(self, side: Side, best: np.ndarray, items: int) -> Relevance | None:
        """The model's relevance scale for one search of the images ('images') or the sentences ('sentences')
        in a collection of `items` items whose ranking's best scores are `best` (`relevance_at`); None: the
        model has none."""
        return relevance_at(self.bundle, side, best, items)

    def warm_up(self) -> float:
        """One search and one annotation, so that lazily loaded parts (parser, backbone) are ready."""
        t0 = time.perf_counter()
        self.images.search(WARMUP_SENTENCE, 1)
        if self.sentences is not None:
            blank = Image.new("RGB", (WARMUP_SIDE, WARMUP_SIDE), (128, 128, 128))
            self.sentences.annotate(blank, 1)
        seconds = time.perf_counter() - t0
        logger.info("warm-up took %.1fs", seconds)
        return seconds

    # -- reads -----------------------------------------------------------------------------------
    def search_images(self, sentence: str, k: int, offset: int = 0, where: PlaceFilter | None = None
                      ) -> Page[ImageHit]:
        """Images ranked offset + 1 .. offset + k for a sentence (among those that pass `where`)."""
        with matched_as("sentence"):
            return self.images.search(sentence, k, offset, where=where)

    def explain(self, image_id: int, sentence: str) -> Explanation | None:
        with matched_as("sentence"):
            return self.images.explain(image_id, sentence)

    def similar_to_image(self, image_id: int, k: int, offset: int = 0) -> tuple[tuple[int, int], Similar] | None:
        """The size of an indexed image and the images like it (itself left out), or None when there is
        no such image."""
        found = similar_to_indexed(self.images, self.sentences, image_id, k, offset)
        if found is None:
            return None
        rec, similar = found
        return (rec.width, rec.height), similar

    def similar_to_upload(self, data: bytes, k: int, offset: int = 0) -> tuple[Photo, Similar]:
        """Images like an uploaded one; the descriptions' alignments are in the upload's pixels."""
        photo = self.read(data)
        return photo, similar_to_image(self.images, self.sentences, photo, k, offset)

    def duplicates(self, image_id: int, threshold: float) -> list[Duplicate] | None:
        """Near-duplicates of an indexed image, or None when there is no such image."""
        return duplicates_of(self.images, image_id, threshold)

    def search_fragments(self, phrase: str, k: int, offset: int = 0) -> Page[RegionHit]:
        """Regions ranked offset + 1 .. offset + k for a phrase."""
        with matched_as("phrase"):
            return self.images.search_fragments(phrase, k, offset)

    def search_triplet(self, relation: str, w1: str, w2: str, k: int, offset: int = 0) -> Page[RegionHit]:
        """Regions for one triplet: embedded as is when its relation is kept and its words are known,
        otherwise its words are read as a phrase."""
        return self.search_fragments(f"{relation}({w1}, {w2})", k, offset)

    def read(self, data: bytes, full: bool = False) -> Photo:
        """An upload decoded for reading (a large JPEG at a reduced size: the model's decode_side), or in full
        (``full``: to be stored); a 4xx ApiError when it cannot be."""
        try:
            return self.reader.read(data, full=full)
        except ImageReadError as e:
            raise image_error(e) from e

    def annotate(self, data: bytes, k: int, offset: int = 0) -> tuple[Photo, Page[SentenceHit]]:
        """Sentences ranked offset + 1 .. offset + k for an uploaded image."""
        if self.sentences is None:
            if not self.settings.has_sentences:
                raise ApiError(409, "no_sentences", "no sentence collection to rank: /annotate needs a caption "
                               "file (FRAGSEARCH_CAPTIONS, one sentence a line) or a data folder with captions.txt "
                               f"(FRAGSEARCH_DATA; {self.settings.data} has none)")
            raise ApiError(503, "not_ready", "no sentence collection is loaded")
        photo = self.read(data)
        return photo, self.sentences.annotate(photo, k, offset)

    def thumbnail_file(self, image_id: int, size: int | None) -> Path | None:
        """The cached thumbnail of an indexed image (made when missing; size None: a full-size JPEG rendition),
        or None when there is no such image; an image file that cannot be decoded is a 422 (its original is
        still served with ?original=true)."""
        path = self.image_file(image_id)
        if path is None:
            return None
        try:
            return thumbnail(path, size, self.settings.thumbnails_dir, self.settings.max_pixels)
        except ImageReadError as e:
            raise ApiError(422, "no_thumbnail", f"image {image_id} has no thumbnail: {e}") from e

    def image_file(self, image_id: int) -> Path | None:
        """The file of an indexed image, or None: only paths the index holds are ever served."""
        rec = self.images.get(image_id)
        if rec is None:
            return None
        path = Path(rec.path)
        return path if path.is_file() else None

    # -- writes (serialised) ---------------------------------------------------------------------
    def resync(self) -> SyncReport:
        """Bring the served image index, open in this process, in step with the collection folder again (the
        watcher's call after photos changed; index/sync.py `sync_folder`, one worker), as a write. The start's
        sync of a collection before the index is opened is index/sync.py `sync_collection`."""
        folder = self.settings.collection
        if folder is None:
            raise ValueError("no collection folder is served")
        with self._write_lock:
            return sync_folder(self.images, folder, workers=1, exclude=self.settings.exclude)

    def add_image(self, data: bytes, filename: str | None) -> ImageRecord:
        """Decode, store under the uploads folder, index and save; on failure nothing changes."""
        decoded = self.read(data, full=True).image
        uploads = self.settings.uploads
        uploads.mkdir(parents=True, exist_ok=True)
        stem = uuid.uuid4().hex
        path = uploads / f"{stem}.jpg"
        name = safe_name(filename, f"{stem}.jpg")
        with self._write_lock:
            image_id: int | None = None
            try:
                decoded.save(path, UPLOAD_FORMAT, quality=UPLOAD_QUALITY)
                [image_id] = self.images.add([decoded], [name], [path])
                self.images.save()
            except BaseException as e:
                if image_id is not None:
                    self.images.remove(image_id)
                path.unlink(missing_ok=True)
                full = storage_error(e, "the image was not added; the index is as it was") \
                    if isinstance(e, OSError) else None
                if full is not None:
                    logger.error("could not save the index after an upload: %s", e)
                    raise full from e
                raise
            rec = self.images.get(image_id)
        assert rec is not None
        logger.info("indexed upload %s as image %d (%dx%d)", name, image_id, decoded.width, decoded.height)
        return rec

    def remove_image(self, image_id: int) -> bool:
        """Remove from the index (and delete the file if the service stored it); False if unknown."""
        with self._write_lock:
            rec = self.images.get(image_id)
            try:
                removed = rec is not None and self.images.remove(image_id)
            except OSError as e:  # a candidate backend that writes at once (Milvus) on a full disk
                full = storage_error(e, f"image {image_id} was not removed; the index is as it was")
                if full is None:
                    raise
                raise full from e
            if rec is None or not removed:
                return False
            try:
                self.images.save()
            except OSError as e:
                full = storage_error(e, f"image {image_id} is no longer served but its removal is not saved "
                                     "(it is saved with the next write that succeeds)")
                if full is None:
                    raise
                logger.error("could not save the index after removing image %d: %s", image_id, e)
                raise full from e
            path = Path(rec.path)
            if self._owned(path):
                path.unlink(missing_ok=True)
        logger.info("removed image %d (%s)", image_id, rec.name)
        return True

    def _owned(self, path: Path) -> bool:
        try:
            return path.resolve().is_relative_to(self.settings.uploads.resolve())
        except OSError:
            return False
