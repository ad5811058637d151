"""The index bench measures what it says: its sweep keeps the candidate stage on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.index_bench import N_FRAGMENTS, K, Synthetic, agreement, scoring_bundle, sweep
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.images import embedded_images, exact_top_k
from fragsearch.model.embed import EmbeddedSentence


def test_sweep_measures_the_candidate_stage_on_a_collection_searches_would_scan(tmp_path: Path) -> None:
    h, n = 32, 300
    gen = Synthetic(h, topics=50)
    index = ImageIndex.create(tmp_path / "small", scoring_bundle(h), IndexSettings())
    boxes = np.tile(np.array([0, 0, 224, 224], np.float32), (n, N_FRAGMENTS, 1))
    names = [f"syn{i}" for i in range(n)]
    index.add(embedded_images(gen.images(0, n), boxes, np.full((n, 2), 224)), names, names, read_places=False)
    assert index.ranker.small()  # the service's policy: a search scans this collection exactly
    queries = gen.queries(12)
    truth = [[i for i, _ in r] for r in exact_top_k(index, queries, K)]

    def measure() -> float:
        return agreement([[hit.image_id for hit in index.search(EmbeddedSentence(q), K).hits] for q in queries], truth)

    few, every = sweep(index, [IndexSettings.of(k_prime=1), IndexSettings.of(k_prime=n * N_FRAGMENTS)], measure, 1)
    assert few < 0.9  # one neighbour per query fragment: the candidates miss images, as measured
    assert every == 1.0  # every fragment a candidate: the exact ranking
    index.close()
