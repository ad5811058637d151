"""S_kl, alignment, the MIL label rule and the objectives on hand-computed examples."""

import torch

from model.objectives import fragment_loss, global_loss, mil_labels
from model.score import align, flatten, fragment_scores, pair_contributions, skl


def test_skl_matches_hand_computed_example():
    # one image with 2 fragments, one sentence with 3 fragments, h = 2
    img = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])  # (1, 2, 2)
    sent = torch.tensor([[[3.0, 1.0], [-1.0, 0.5], [0.0, -4.0]]])  # (1, 3, 2)
    # dots: v1.s = 3, -1, 0 ; v2.s = 2, 1, -8 -> positives 3 + 2 + 1 = 6
    expected = 6.0 / (2 * (3 + 5))
    s = skl(img, torch.ones(1, 2), sent, torch.ones(1, 3))
    assert torch.allclose(s, torch.tensor([[expected]]))


def test_skl_padding_is_ignored_and_chunking_is_exact():
    torch.manual_seed(0)
    img = torch.randn(3, 4, 8)
    sent = torch.randn(5, 6, 8)
    sent_mask = torch.ones(5, 6)
    sent_mask[1, 3:] = 0
    full = skl(img, torch.ones(3, 4), sent, sent_mask)
    # sentence 1 alone, only its 3 real fragments
    alone = skl(img, torch.ones(3, 4), sent[1:2, :3], torch.ones(1, 3))
    assert torch.allclose(full[:, 1:2], alone, atol=1e-6)
    assert torch.allclose(skl(img, torch.ones(3, 4), sent, sent_mask, chunk=2), full, atol=1e-6)
    # garbage in padded slots changes nothing
    sent2 = sent.clone()
    sent2[1, 3:] = 100.0
    assert torch.allclose(skl(img, torch.ones(3, 4), sent2, sent_mask), full, atol=1e-6)
    # and on the image side: image 2 has 2 real fragments, garbage in its padded slots
    img_mask = torch.ones(3, 4)
    img_mask[2, 2:] = 0
    img2 = img.clone()
    img2[2, 2:] = -50.0
    padded = skl(img2, img_mask, sent, sent_mask)
    assert torch.allclose(padded[:2], full[:2], atol=1e-6)
    assert torch.allclose(padded[2:], skl(img[2:, :2], torch.ones(1, 2), sent, sent_mask), atol=1e-6)


def test_skl_smoothing_favours_no_short_sentences():
    img = torch.ones(1, 1, 1)
    short = skl(img, torch.ones(1, 1), torch.ones(1, 1, 1), torch.ones(1, 1))
    assert torch.allclose(short, torch.tensor([[1.0 / 6.0]]))


def test_alignment_picks_best_positive_fragment():
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    sent = torch.tensor([[0.0, 2.0], [-1.0, -1.0]])
    al = align(img, sent)
    assert al.image_fragment[0] == 1 and abs(al.score[0] - 2.0) < 1e-6 and al.matched[0]
    assert not al.matched[1]


def test_mil_labels_rule():
    # rows: 3 image fragments of image A; columns: 2 fragments of A's sentence, 1 of another sentence
    scores = torch.tensor([[0.5, -1.0, 0.2], [-0.2, -0.5, 0.9], [-0.1, -2.0, -1.0]])
    in_pair = torch.tensor([[True, True, False]] * 3)
    y = mil_labels(scores, in_pair, mil=True)
    # inside the pair: y = sign(score) for sentence fragment 0
    assert y[:, 0].tolist() == [1.0, -1.0, -1.0]
    # sentence fragment 1 scores -1, -0.5, -2: no positive, so its best bag member (row 1) becomes +1
    assert y[:, 1].tolist() == [-1.0, 1.0, -1.0]
    # a non-corresponding pair stays -1 whatever the score
    assert (y[:, 2] == -1).all()
    dense = mil_labels(scores, in_pair, mil=False)
    assert (dense[:, :2] == 1).all() and (dense[:, 2] == -1).all()


def test_fragment_loss_zero_when_separated_and_positive_otherwise():
    img = torch.tensor([[[2.0, 0.0]], [[0.0, 2.0]]])  # 2 images, 1 fragment each
    sent = torch.tensor([[[2.0, -2.0]], [[-2.0, 2.0]]])  # sentence k matches image k
    pos = torch.eye(2, dtype=torch.bool)
    ones_i, ones_s = torch.ones(2, 1), torch.ones(2, 1)
    assert float(fragment_loss(flatten(img, ones_i, sent, ones_s), pos, mil=False)) == 0.0
    assert float(fragment_loss(flatten(img, ones_i, sent.flip(0), ones_s), pos, mil=False)) > 1.0


def test_flat_scores_skip_padding():
    torch.manual_seed(1)
    img, sent = torch.randn(2, 3, 4), torch.randn(3, 5, 4)
    mask = torch.ones(3, 5)
    mask[0, 2:] = 0
    flat = flatten(img, torch.ones(2, 3), sent, mask)
    assert flat.scores.shape == (6, 12)
    assert flat.sent_of.tolist() == [0, 0] + [1] * 5 + [2] * 5


def test_global_loss_hinge():
    s = torch.tensor([[1.0, 0.2], [0.1, 1.0]])
    pos = torch.eye(2, dtype=torch.bool)
    assert float(global_loss(s, pos, torch.tensor([0, 1]), margin=0.5)) == 0.0
    # margin 1: violations 0.2 and 0.1 in each direction
    loss = global_loss(s, pos, torch.tensor([0, 1]), margin=1.0)
    assert abs(float(loss) - ((0.1 + 0.2) + (0.2 + 0.1)) / 2) < 1e-6


def test_global_loss_top_k_keeps_hardest_negatives():
    s = torch.tensor([[1.0, 0.2, 0.6], [0.1, 1.0, 0.3], [0.5, 0.4, 1.0]])
    pos = torch.eye(3, dtype=torch.bool)
    pair = torch.tensor([0, 1, 2])
    margin = 1.0
    # per pair l: violations of other images (column) and other sentences (row of its image)
    img_v = [[0.1, 0.5], [0.2, 0.4], [0.6, 0.3]]
    sent_v = [[0.2, 0.6], [0.1, 0.3], [0.5, 0.4]]
    every = sum(sum(a) + sum(b) for a, b in zip(img_v, sent_v, strict=True)) / 3
    hardest = sum(max(a) + max(b) for a, b in zip(img_v, sent_v, strict=True)) / 3
    assert abs(float(global_loss(s, pos, pair, margin)) - every) < 1e-6
    assert abs(float(global_loss(s, pos, pair, margin, top_k=1)) - hardest) < 1e-6
    assert abs(float(global_loss(s, pos, pair, margin, top_k=5)) - every) < 1e-6


def test_fragment_scores_shape():
    assert fragment_scores(torch.zeros(2, 3, 4), torch.zeros(5, 6, 4)).shape == (2, 3, 5, 6)


def test_pair_contributions_are_each_pairs_share_of_skl():
    torch.manual_seed(3)
    img, sent = torch.randn(6, 8), torch.randn(4, 8)
    dots, shares = pair_contributions(img, sent)
    for i in range(6):  # a naive loop: v_i . s_j, and max(0, v_i . s_j) / (|g_k| (|g_l| + n))
        for j in range(4):
            dot = float(sum(img[i, d] * sent[j, d] for d in range(8)))
            assert abs(float(dots[i, j]) - dot) < 1e-5
            assert abs(float(shares[i, j]) - max(0.0, dot) / (6 * (4 + 5.0))) < 1e-6
    total = skl(img[None], torch.ones(1, 6), sent[None], torch.ones(1, 4))[0, 0]
    assert torch.allclose(shares.sum(), total, atol=1e-6)
