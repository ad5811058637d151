"""The served path on two placements, compared: one collection, searched through the candidate stage
and served over HTTP, answers the same queries alike on the CPU and with FAISS on a GPU.

`prepare` builds the collection (the coloured-shapes dev images and the train + dev captions) with
`exact_below` 0, so that every search goes through FAISS as a collection above the limit does: the
images by k-NN (k' = 128), the sentences by every fragment with a positive score (k' = 0, the range
search that FAISS's GPU indexes do not have). `answers` asks /readyz, /search/images, /annotate and
/search/fragments; `assert_same_answers` wants the same ids in the same order and the scores within a
tolerance. tests/test_gpu.py serves it on CUDA with faiss-gpu; tests/test_placement.py on the CPU
with the policy's GPU decisions taken against a stand-in FAISS GPU (tests/gpu_stand_in.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from fragsearch.index import ImageIndex, IndexSettings, SentenceIndex
from fragsearch.index.sentences import DEFAULT_SETTINGS as SENTENCE_SETTINGS
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.settings import Settings
from tests.conftest import ShapesModel
from tests.conftest_service import make_settings

K = 10
RTOL, ATOL = 1e-4, 1e-5  # CUDA's and the CPU's sums of the same products differ in the last digits


@dataclass
class Collection:
    """A prepared collection: `root` holds images/ and sentences/; the queries asked of it."""

    root: Path
    shapes: ShapesModel
    sentences: list[str]
    uploads: list[bytes]
    phrases: list[str]

    def settings(self, **overrides: object) -> Settings:
        """Service settings over the collection (no warm-up: its fixed sentence has no word of the shapes
        model's vocabulary; the queries' /annotate is the warm-up's annotation)."""
        return make_settings(self.shapes, self.root, **overrides)


def prepare(shapes: ShapesModel, root: Path) -> Collection:
    """Image and sentence indexes over the shapes collection, searched through FAISS (exact_below 0)."""
    bundle = shapes.bundle
    dev, train = load_split(shapes.data, "dev"), load_split(shapes.data, "train")
    images = ImageIndex.create(root / "images", bundle, IndexSettings.of(exact_below=0),
                               cache=feature_cache(shapes.cache, bundle.image_cfg))
    images.photos.add([dev.image_path(n) for n in dev.images])
    images.save()
    sentences = SentenceIndex.create(root / "sentences", bundle, SENTENCE_SETTINGS.with_search(exact_below=0))
    sentences.add(train.sentences()[0] + dev.sentences()[0])
    sentences.save()
    for index in (images, sentences):
        assert index.n_fragments > index.settings.search.exact_below  # every search goes through the candidates
        index.close()
    return Collection(root, shapes, [captions[0] for captions in dev.captions[:5]] + ["a red circle"],
                      [dev.image_path(n).read_bytes() for n in dev.images[:3]],
                      ["red circle", "blue square", "amod(circle, red)"])


Hit = tuple[tuple[Any, ...], float]  # what identifies a hit (ids, aligned fragments), its score
Answers = dict[str, list[list[Hit]]]  # route -> per query, its ranking


def answers(client: TestClient, collection: Collection) -> Answers:
    """Every query's ranking: per image its id and aligned fragments, per sentence its id, per region
    its image id and fragment; each with its score."""
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text

    def post(path: str, **kw: Any) -> list[dict[str, Any]]:
        r = client.post(path, **kw)
        assert r.status_code == 200, r.text
        results: list[dict[str, Any]] = r.json()["results"]
        assert results, f"{path} found nothing"
        return results

    return {
        "images": [[((h["id"], *(m["fragment"] for m in h["alignment"])), h["score"])
                    for h in post("/search/images", json={"sentence": s, "k": K})] for s in collection.sentences],
        "annotate": [[((h["id"],), h["score"]) for h in post("/annotate", files={"file": ("q.jpg", b, "image/jpeg")},
                                                             data={"k": str(K)})] for b in collection.uploads],
        "fragments": [[((h["image_id"], h["fragment"]), h["score"])
                       for h in post("/search/fragments", json={"phrase": p, "k": K})] for p in collection.phrases],
    }


def assert_same_answers(got: Answers, want: Answers) -> None:
    """The same ids (and fragments) in the same order for every query; scores within RTOL / ATOL."""
    assert got.keys() == want.keys()
    for route in want:
        for q, (a, b) in enumerate(zip(got[route], want[route], strict=True)):
            where = f"{route} query {q}"
            assert [key for key, _ in a] == [key for key, _ in b], where
            for (key, x), (_, y) in zip(a, b, strict=True):
                assert math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL), (where, key, x, y)
