"""The relevance-by-collection-size benchmark's helpers (bench/relevance_sizes.py): a drawn collection's
captions renumbered to its images, and the mean relevance of the pairs shown at the cut-off."""

from __future__ import annotations

import numpy as np

from bench.relevance_sizes import shown_relevance, subset
from fragsearch.training.relevance import reliability


def test_a_drawn_collection_keeps_its_images_captions_renumbered() -> None:
    pair_image = np.array([0, 0, 1, 2, 2, 3, 4])
    sents, pair = subset(pair_image, np.array([1, 2, 4]))
    assert sents.tolist() == [2, 3, 4, 6] and pair.tolist() == [0, 1, 1, 2]


def test_the_shown_relevance_is_the_mean_of_the_pairs_at_or_above_the_cut_off() -> None:
    pred = np.array([0.1, 0.45, 0.5, 0.55, 0.9, 0.99])
    truth = np.array([0, 1, 0, 1, 1, 0], bool)
    table = [{"direction": "search", **r} for r in reliability(pred, truth)]
    table += [{"direction": "annotate", **r} for r in reliability(np.array([0.2]), np.array([True]))]
    assert np.isclose(shown_relevance(table, "search"), pred[pred >= 0.5].mean(), atol=1e-4)
    assert np.isnan(shown_relevance(table, "annotate"))  # nothing shown at the cut-off
