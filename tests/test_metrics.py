"""Recall metrics against a hand-made ranking."""

import numpy as np

from fragsearch.training.evaluate import annotation_ranks, metrics_from_scores, search_ranks


def test_ranks_on_hand_made_scores():
    # 3 images, 2 sentences each: sentence l describes image l // 2
    pair = np.array([0, 0, 1, 1, 2, 2])
    scores = np.array(
        [
            [0.9, 0.1, 0.5, 0.2, 0.0, 0.0],  # image 0: best own 0.9 ranks 1st
            [0.8, 0.7, 0.3, 0.6, 0.95, 0.1],  # image 1: best own 0.6 -> 0.8, 0.7, 0.95 ahead -> rank 4
            [0.1, 0.1, 0.1, 0.1, 0.2, 0.1],  # image 2: own 0.2 best -> rank 1
        ]
    )
    assert annotation_ranks(scores, pair).tolist() == [1, 4, 1]
    # sentence 0: image 0 (0.9) top -> 1; sentence 3: image 1 0.6, image 0 0.2 -> 1;
    # sentence 1: own 0.1, image 1 0.7 ahead and image 2 ties at 0.1 (counted against) -> 3;
    # sentence 5: image 1 ties own 0.1 -> 2
    assert search_ranks(scores, pair).tolist() == [1, 3, 2, 1, 2, 2]
    m = metrics_from_scores(scores, pair)
    assert abs(m["annot_r1"] - 200 / 3) < 1e-9 and m["annot_r5"] == 100.0
    assert abs(m["search_r1"] - 100 * 2 / 6) < 1e-9 and m["search_medr"] == 2.0


def test_hub_occurrence_counts_the_image_in_most_top_lists():
    from fragsearch.training.evaluate import hub_occurrence

    scores = np.array([[5.0, 5.0, 5.0, 0.0],  # image 0 tops three of the four sentences
                       [1.0, 0.0, 2.0, 3.0],
                       [0.0, 1.0, 0.0, 2.0]])
    assert hub_occurrence(scores, top=1) == 3
    assert hub_occurrence(scores, top=3) == 4  # every image is in every top 3
    assert hub_occurrence(np.eye(3), top=1) == 1  # no hub
    assert hub_occurrence(np.zeros((0, 4))) == 0


def test_ties_on_the_annotation_side_hodosh_and_mean_rank():
    from fragsearch.training.evaluate import split_metrics

    # 2 images, 2 sentences each (sentences 0 and 2 are each image's first)
    pair = np.array([0, 0, 1, 1])
    scores = np.array([[0.5, 0.2, 0.5, 0.1],   # image 0: its best 0.5 ties sentence 2 (another image's) -> rank 2
                       [0.3, 0.3, 0.3, 0.3]])  # image 1: its best 0.3 ties sentences 0 and 1 -> rank 3
    assert annotation_ranks(scores, pair).tolist() == [2, 3]  # a tie with its own other sentence is no loss
    assert search_ranks(scores, pair).tolist() == [1, 2, 2, 1]
    m = split_metrics(scores, pair)
    assert (m["annot_r1"], m["annot_meanr"], m["annot_medr"]) == (0.0, 2.5, 2.0)
    assert (m["search_r1"], m["search_meanr"], m["search_medr"]) == (50.0, 1.5, 1.0)
    # Hodosh: first sentences only -> columns 0 and 2; image 0 ties (rank 2), image 1 is below (rank 2)
    assert (m["hodosh_annot_r1"], m["hodosh_annot_meanr"]) == (0.0, 2.0)
    # sentence 0: image 0 first; sentence 2: image 0 (0.5) above its own image 1 (0.3)
    assert (m["hodosh_search_r1"], m["hodosh_search_meanr"], m["hodosh_search_r5"]) == (50.0, 1.5, 100.0)
    assert m["rsum"] == 0.0 + 100.0 + 100.0 + 50.0 + 100.0 + 100.0
