"""S_kl, alignment, the MIL label rule and the objectives on hand-computed examples."""

import math

import numpy as np
import pytest
import torch

from fragsearch.model.score import FlatFragments, align, flatten, fragment_scores, pair_contributions, skl, skl_of_items
from fragsearch.training.objectives import (
    contrastive_global_loss,
    fragment_loss,
    global_loss,
    mil_labels,
    two_branch_loss,
)


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


def test_contrastive_global_loss_matches_a_hand_computed_softmax():
    # images 0 and 1; sentences 0, 1 of image 0 and sentence 2 of image 1
    s = torch.tensor([[0.9, 0.4, 0.1], [0.2, 0.3, 0.8]])
    pair = torch.tensor([0, 0, 1])
    pos = pair[None, :] == torch.arange(2)[:, None]
    scale = 2.0

    def nll(true: float, negatives: list[float]) -> float:
        return -math.log(math.exp(scale * true) / sum(math.exp(scale * x) for x in [true, *negatives]))

    # rank images: each sentence against the other image; rank sentences: each pair against the
    # sentences not of its image (sentence 1 is not a negative of sentence 0, nor 0 of 1)
    expected = (nll(0.9, [0.2]) + nll(0.9, [0.1])
                + nll(0.4, [0.3]) + nll(0.4, [0.1])
                + nll(0.8, [0.1]) + nll(0.8, [0.2, 0.3])) / 3
    assert abs(float(contrastive_global_loss(s, pos, pair, scale)) - expected) < 1e-6
    # a wider margin of the true pairs lowers it
    wider = s + torch.where(pos, 0.5, 0.0)
    assert float(contrastive_global_loss(wider, pos, pair, scale)) < expected


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


def test_skl_of_a_random_batch_matches_a_double_loop():
    """Several images and sentences of different fragment counts (padding on both sides) against
    the formula written out: S_kl = sum_i sum_j max(0, v_i . s_j) / (|g_k| (|g_l| + n))."""
    gen = torch.Generator().manual_seed(3)
    img, sent = torch.randn(4, 5, 6, generator=gen), torch.randn(6, 7, 6, generator=gen)
    n_img, n_sent = [5, 2, 4, 1], [7, 1, 3, 6, 2, 5]
    img_mask = (torch.arange(5)[None, :] < torch.tensor(n_img)[:, None]).float()
    sent_mask = (torch.arange(7)[None, :] < torch.tensor(n_sent)[:, None]).float()
    want = torch.zeros(4, 6)
    for k in range(4):
        for m in range(6):
            total = 0.0
            for i in range(n_img[k]):
                for j in range(n_sent[m]):
                    total += max(0.0, sum(float(img[k, i, d] * sent[m, j, d]) for d in range(6)))
            want[k, m] = total / (n_img[k] * (n_sent[m] + 5))
    assert torch.allclose(skl(img, img_mask, sent, sent_mask), want, atol=1e-5)
    assert torch.allclose(skl(img, img_mask, sent, sent_mask, chunk=4), want, atol=1e-5)
    assert torch.allclose(skl(img, img_mask, sent, sent_mask, smoothing=0.0),
                          want * (torch.tensor(n_sent)[None, :] + 5) / torch.tensor(n_sent)[None, :], atol=1e-5)


def test_mil_gives_the_bag_its_own_best_not_the_columns_best():
    # column 0's bag is rows 0 and 1 (both negative); row 2, outside the bag, scores highest in the column
    scores = torch.tensor([[-0.3], [-0.8], [0.9]])
    in_pair = torch.tensor([[True], [True], [False]])
    assert mil_labels(scores, in_pair, mil=True)[:, 0].tolist() == [1.0, -1.0, -1.0]


# three image fragments (rows 0, 1 of image 0; row 2 of image 1) x three sentence fragments
# (columns 0, 1 of sentence 0, which describes image 0; column 2 of sentence 1, describing image 1)
FLAT = FlatFragments(torch.tensor([[0.5, -0.4, 0.3], [-0.2, -0.6, -0.1], [0.7, 0.2, -0.5]]),
                     torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1]), 2, 2)


def test_fragment_loss_with_mil_on_a_hand_computed_batch():
    pos = torch.eye(2, dtype=torch.bool)
    # MIL labels: column 0 follows the signs in its bag (+1, -1); column 1 has no positive in its bag,
    # so its bag's best (row 0, -0.4) is +1 (not row 2, the column's best at 0.2); column 2's only
    # bag member (row 2) is +1. Everything outside a bag is -1.
    assert mil_labels(FLAT.scores, pos[FLAT.img_of][:, FLAT.sent_of], mil=True).tolist() == [
        [1.0, 1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, 1.0]]
    # hinges max(0, 1 - y s): positives 0.5, 1.4, 1.5; negatives 1.3, 0.8, 0.4, 0.9, 1.7, 1.2
    balanced = (0.5 + 1.4 + 1.5) / 3 + (1.3 + 0.8 + 0.4 + 0.9 + 1.7 + 1.2) / 6
    assert abs(float(fragment_loss(FLAT, pos, mil=True)) - balanced) < 1e-6
    assert abs(float(fragment_loss(FLAT, pos, mil=True, balanced=False)) - 9.7 / 9) < 1e-6
    # dense: every pair inside a corresponding image-sentence pair is +1
    dense = (0.5 + 1.4 + 1.2 + 1.6 + 1.5) / 5 + (1.3 + 0.9 + 1.7 + 1.2) / 4
    assert abs(float(fragment_loss(FLAT, pos, mil=False)) - dense) < 1e-6


def test_two_branch_loss_on_a_hand_computed_batch():
    # images along the axes; sentences 0, 1 describe image 0 and sentences 2, 3 image 1
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    txt = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [0.8, 0.6]])
    pair = torch.tensor([0, 0, 1, 1])
    pos = pair[None, :] == torch.arange(2)[:, None]
    r2, near, far = math.sqrt(2.0), math.sqrt(0.4), math.sqrt(0.8)  # distances |x - y| of the unit vectors
    close = math.sqrt(0.08)  # |txt1 - txt3|
    m = 0.5

    def relu(x: float) -> float:
        return max(0.0, x)

    # sentence -> image: each sentence's image closer than the other image (the one negative)
    s2i = (relu(m + 0 - r2) + relu(m + far - near) + relu(m + 0 - r2) + relu(m + far - near)) / 4
    # image -> sentence, hardest negative: the anchor image closer to its sentence than to others' sentences
    i2s = (relu(m + 0 - near) + relu(m + far - near) + relu(m + 0 - near) + relu(m + far - near)) / 4
    # structure: a sentence closer to its image's other sentence (distance `far` for both pairs) than to
    # the other image's sentences, hardest negative
    struct = (relu(m + far - near) + relu(m + far - close) + relu(m + far - near) + relu(m + far - close)) / 4
    want = s2i + 2.0 * i2s + 0.1 * struct
    got = two_branch_loss(img, txt, pos, pair, margin=m, top_k=1, lambda_img=2.0, lambda_struct=0.1)
    assert abs(float(got) - want) < 1e-5
    assert abs(want - 1.2366357) < 1e-6  # the same sum, evaluated once by hand
    # pulled apart by more than the margin, every term is zero
    apart = two_branch_loss(img, torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]), pos, pair,
                            margin=0.1, top_k=1)
    assert float(apart) == 0.0


def test_blocks_threshold_each_slice_and_their_shares_sum_to_the_score() -> None:
    torch.manual_seed(3)
    img, sent = torch.randn(2, 4, 6), torch.randn(3, 5, 6)
    img_mask, sent_mask = torch.ones(2, 4), torch.ones(3, 5)
    by_slice = sum(skl(img[..., p], img_mask, sent[..., p], sent_mask) for p in (slice(0, 2), slice(2, 4), slice(4, 6)))
    torch.testing.assert_close(skl(img, img_mask, sent, sent_mask, blocks=3), by_slice)
    torch.testing.assert_close(skl(img, img_mask, sent, sent_mask, chunk=1, blocks=3), by_slice)
    dots, shares = pair_contributions(img[0], sent[1], blocks=3)
    torch.testing.assert_close(dots, img[0] @ sent[1].T)
    torch.testing.assert_close(shares.sum(), by_slice[0, 1])
    al = align(img[0], sent[1], blocks=3)
    assert al.image_fragment == [int(i) for i in shares.argmax(dim=0)]
    assert all(al.matched) == bool((shares.max(dim=0).values > 0).all())
    with pytest.raises(ValueError, match="equal blocks"):
        skl(img, img_mask, sent, sent_mask, blocks=4)


def test_one_block_is_the_papers_score_exactly() -> None:
    torch.manual_seed(4)
    img, sent = torch.randn(2, 4, 6), torch.randn(3, 5, 6)
    img_mask, sent_mask = torch.ones(2, 4), torch.ones(3, 5)
    flat = flatten(img, img_mask, sent, sent_mask)
    assert flat.positive is None  # the training path: no second (I, J) matrix
    ref = torch.einsum("kfh,lth->klft", img, sent).clamp_min(0).sum((2, 3)) / (4 * (5 + 5.0))
    torch.testing.assert_close(skl(img, img_mask, sent, sent_mask), ref)
    best, idx = (img[0] @ sent[0].T).max(dim=0)
    al = align(img[0], sent[0])
    assert al.image_fragment == idx.tolist() and al.score == best.tolist()  # the raw best, negative or not


def test_skl_of_items_from_unpadded_products_is_the_padded_skl() -> None:
    """The form the prescore scores candidates in (index.codes): each item's real fragments one after
    another, their products with one sentence, the item of each row."""
    torch.manual_seed(3)
    sizes = [4, 1, 3, 4, 2]
    img = torch.randn(len(sizes), 4, 6)
    mask = torch.zeros(len(sizes), 4)
    for k, n in enumerate(sizes):
        mask[k, :n] = 1
    sent = torch.randn(1, 5, 6)
    real = torch.cat([img[k, :n] for k, n in enumerate(sizes)])
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    got = skl_of_items(real @ sent[0].T, owner, len(sizes))
    assert torch.allclose(got, skl(img, mask, sent, torch.ones(1, 5))[:, 0], atol=1e-6)


@pytest.mark.parametrize("blocks", [1, 2])
def test_the_one_skl_gives_numpy_arrays_and_torch_tensors_the_same_numbers(blocks: int) -> None:
    """The runtime scores NumPy arrays and training torch tensors with the same functions: the same S_kl,
    alignments, pair shares and calibration scales, to float rounding."""
    from fragsearch.model.calibration import Calibration

    rng = np.random.default_rng(3)
    img = rng.standard_normal((9, 6, 8)).astype(np.float32)
    img_mask = np.ones((9, 6), np.float32)
    img_mask[4, 2:] = 0
    sent = rng.standard_normal((5, 7, 8)).astype(np.float32)
    sent_mask = np.ones((5, 7), np.float32)
    sent_mask[2, 3:] = 0
    as_t = [torch.from_numpy(x) for x in (img, img_mask, sent, sent_mask)]
    got = skl(img, img_mask, sent, sent_mask, blocks=blocks)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, skl(*as_t, blocks=blocks).numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(skl(img, img_mask, sent, sent_mask, chunk=2, blocks=blocks), got, rtol=1e-6)
    a_np, a_t = align(img[0], sent[0], blocks), align(as_t[0][0], as_t[2][0], blocks)
    assert a_np.image_fragment == a_t.image_fragment and a_np.matched == a_t.matched
    np.testing.assert_allclose(a_np.score, a_t.score, rtol=1e-5)
    for x, y in zip(pair_contributions(img[1], sent[1], blocks=blocks),
                    pair_contributions(as_t[0][1], as_t[2][1], blocks=blocks), strict=True):
        np.testing.assert_allclose(x, y.numpy(), rtol=1e-5, atol=1e-7)
    if blocks == 1:
        dots = img.reshape(-1, 8) @ sent[0].T
        owner = np.repeat(np.arange(9), 6)
        np.testing.assert_allclose(skl_of_items(dots, owner, 9), skl(img, np.ones((9, 6), np.float32), sent[:1],
                                                                     np.ones((1, 7), np.float32))[:, 0], rtol=1e-5)
    cal_np = Calibration(img, sent, sent_mask)
    cal_t = Calibration(as_t[0], as_t[2], as_t[3])
    np.testing.assert_allclose(cal_np.calibrate_images(img, blocks), cal_t.calibrate_images(as_t[0], blocks).numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cal_np.calibrate_sentences(sent, sent_mask, blocks),
                               cal_t.calibrate_sentences(as_t[2], as_t[3], blocks).numpy(), rtol=1e-5, atol=1e-6)
