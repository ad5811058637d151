"""The re-ranking benchmark's densities (bench/rerank_bench.py): the mean of an item's k best scores on the
other side, and the same with the query image (or sentence) left out, against a direct computation."""

from __future__ import annotations

import numpy as np

from bench.rerank_bench import top_mean, top_mean_leaving_out_each, top_mean_leaving_out_each_sentence


def test_the_k_best_mean_along_either_axis() -> None:
    scores = np.random.default_rng(0).normal(size=(7, 9))
    for k in (1, 3, 9):
        np.testing.assert_allclose(top_mean(scores, k, 1), np.sort(scores, axis=1)[:, -k:].mean(axis=1))
        np.testing.assert_allclose(top_mean(scores, k, 0), np.sort(scores, axis=0)[-min(k, 7):, :].mean(axis=0))


def test_the_query_image_is_left_out_of_each_sentences_density() -> None:
    scores = np.random.default_rng(1).normal(size=(6, 5))
    scores[2, 3] = scores[4, 3]  # a tie among the best
    for k in (1, 2, 5):
        got = top_mean_leaving_out_each(scores, k)
        for i in range(6):
            others = np.delete(scores, i, axis=0)
            np.testing.assert_allclose(got[i], np.sort(others, axis=0)[-k:, :].mean(axis=0))


def test_the_query_sentence_is_left_out_of_each_images_density() -> None:
    scores = np.random.default_rng(2).normal(size=(4, 7))
    for k in (1, 3, 6):
        got = top_mean_leaving_out_each_sentence(scores, k)
        for j in range(7):
            others = np.delete(scores, j, axis=1)
            np.testing.assert_allclose(got[:, j], np.sort(others, axis=1)[:, -k:].mean(axis=1))
