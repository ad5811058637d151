"""More like this: the ranking is the cosine of mean embedded fragments (kept per index, extended as
images come and go), the descriptions only explain the results shown."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fragsearch.index import ImageIndex, IndexSettings, SentenceIndex
from fragsearch.index.similar import more_like_this, rank_like
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache

if TYPE_CHECKING:
    from tests.conftest import ShapesModel


def test_ranked_by_mean_fragment_cosine_and_explained_by_descriptions(shapes_model: ShapesModel,
                                                                      tmp_path: Path) -> None:
    bundle = shapes_model.bundle
    dev = load_split(shapes_model.data, "dev")
    images = ImageIndex.create(tmp_path / "images", bundle, IndexSettings(),
                               cache=feature_cache(shapes_model.cache, bundle.image_cfg))
    images.photos.add([dev.image_path(n) for n in dev.images[:12]])
    sentences = SentenceIndex.create(tmp_path / "sentences", bundle, IndexSettings())
    sentences.add(load_split(shapes_model.data, "train").sentences()[0][:100])

    def brute(query: int) -> list[int]:
        means = {}
        for i in images.ids().tolist():
            found = images.fragments(int(i))
            assert found is not None
            m = found[0].mean(0)
            means[int(i)] = m / np.linalg.norm(m)
        q = means[query]
        return sorted((i for i in means if i != query), key=lambda i: (-float(means[i] @ q), i))

    query = int(images.ids()[3])
    found = images.fragments(query)
    assert found is not None
    got = more_like_this(images, sentences, *found, k=5, exclude=query)
    assert [h.image_id for h in got.hits] == brute(query)[:5] and got.considered == 11
    assert 1 <= len(got.described_by) <= 5
    assert all(h.alignment for h in got.hits), "each result shown is aligned to the descriptions' triplets"
    page2 = more_like_this(images, sentences, *found, k=5, exclude=query, offset=5)
    assert [h.image_id for h in page2.hits] == brute(query)[5:10]
    assert more_like_this(images, None, *found, k=3, exclude=query).described_by == []  # ranked all the same

    # the kept means follow the index: a new image is ranked, a removed one is not
    added = images.photos.add([dev.image_path(n) for n in dev.images[12:14]]).added
    images.remove(int(images.ids()[0]))
    ids, sims = rank_like(images, found[0], exclude=query)
    assert sorted(ids.tolist()) == sorted(i for i in images.ids().tolist() if i != query)
    assert set(added) <= set(ids.tolist()) and list(ids) == brute(query)
    assert np.all(np.diff(sims) <= 1e-6)
    # an upload (no id to leave out) finds its own indexed copy first
    ids, _ = rank_like(images, np.array(found[0]))
    assert int(ids[0]) == query
