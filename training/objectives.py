"""Training objectives: fragment alignment (dense C_0 and its MIL form C_F), global ranking C_G,
and the two-branch bidirectional ranking loss with the structure term.

Correspondence inside a batch is given by `pos`: (K, L) bool, True where sentence l describes
image k (several sentences of one image may share a batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fragsearch.model.score import FlatFragments


def mil_labels(scores: torch.Tensor, in_pair: torch.Tensor, mil: bool) -> torch.Tensor:
    """Labels y_ij in {-1, +1} for image fragments i (rows) and sentence fragments j (columns).

    scores: (I, J) fragment scores v_i . s_j; in_pair: (I, J) True where fragments i and j come from a
    corresponding image–sentence pair (column j's positive bag = the rows True in it).
    Dense (mil=False): y = +1 inside corresponding pairs, -1 elsewhere.
    MIL (mil=True): inside corresponding pairs y_ij = sign(v_i . s_j); where a sentence fragment would
    then have no positive in its bag, its best-scoring bag member is set to +1. Outside, -1.
    """
    if not mil:
        return torch.where(in_pair, 1.0, -1.0).to(scores.dtype)
    s = scores.detach()
    y_pos = in_pair & (s > 0)
    best = s.masked_fill(~in_pair, float("-inf")).argmax(dim=0)  # (J,)
    needs = in_pair.any(dim=0) & ~y_pos.any(dim=0)  # (J,)
    cols = torch.nonzero(needs).flatten()
    y_pos[best[cols], cols] = True
    return torch.where(y_pos, 1.0, -1.0).to(scores.dtype)


def fragment_loss(flat: FlatFragments, pos: torch.Tensor, mil: bool, balanced: bool = True,
                  boxes: torch.Tensor | None = None) -> torch.Tensor:
    """Fragment alignment objective sum max(0, 1 - y_ij v_i . s_j) over all real fragment pairs of a batch.

    flat: the batch's pairwise fragment scores (model.score.flatten); pos: (K, L) correspondence.
    With `balanced`, positive and negative labels are averaged separately and added (a batch has
    ~100x more negatives than positives); otherwise one mean. `boxes` (I, J) in {-1, 0, +1}: labels that
    people's boxes give (training/boxes.py), in place of the dense or MIL labels where not 0.
    """
    in_pair = pos[flat.img_of][:, flat.sent_of]
    y = mil_labels(flat.scores, in_pair, mil)
    if boxes is not None:
        y = torch.where(boxes != 0, boxes.to(y.dtype), y)
    hinge = torch.relu(1 - y * flat.scores)
    if not balanced:
        return hinge.mean()
    is_pos = y > 0
    n_pos = is_pos.sum().clamp_min(1)
    n_neg = (~is_pos).sum().clamp_min(1)
    return (hinge * is_pos).sum() / n_pos + (hinge * ~is_pos).sum() / n_neg


def global_loss(s: torch.Tensor, pos: torch.Tensor, pair_image: torch.Tensor, margin: float,
                top_k: int = 0, rank_images: bool = True) -> torch.Tensor:
    """Global ranking objective C_G on a batch score matrix.

    s: (K, L) S_kl; pos: (K, L) correspondence; pair_image: (L,) index of sentence l's image.
    For every true pair (k, l): sum over other images k' of max(0, S_k'l - S_kl + margin) (rank images)
    and over sentences l' not of k of max(0, S_kl' - S_kl + margin) (rank sentences). Mean over pairs.
    With `top_k` > 0 only the k most violating negatives of each pair count in each direction
    (top_k = 1: the hardest negative only); 0 sums over all of them, as in the paper.
    The same form over inner products is the DT-RNN's bidirectional ranking loss (Socher et al. Eq. 5);
    with `rank_images` False only the sentences are ranked for each image: DeViSE's hinge rank loss
    (the image the query, its sentences the labels).
    """
    n_sent = s.shape[1]
    true = s[pair_image, torch.arange(n_sent, device=s.device)]  # (L,)
    viol_images = F.relu(s - true[None, :] + margin).masked_fill(pos, 0)  # (K, L)
    rows = s[pair_image]  # (L, L'): S_{k(l), l'}
    viol_sents = F.relu(rows - true[:, None] + margin).masked_fill(pos[pair_image], 0)  # (L, L')
    if top_k > 0:
        ranked_images = viol_images.topk(min(top_k, viol_images.shape[0]), dim=0).values.sum(0)
        rank_sents = viol_sents.topk(min(top_k, viol_sents.shape[1]), dim=1).values.sum(1)
    else:
        ranked_images, rank_sents = viol_images.sum(0), viol_sents.sum(1)
    return (rank_sents + ranked_images).mean() if rank_images else rank_sents.mean()


def contrastive_global_loss(s: torch.Tensor, pos: torch.Tensor, pair_image: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The contrastive (InfoNCE) form of C_G on a batch score matrix, both directions.

    s: (K, L) S_kl; pos: (K, L) correspondence; pair_image: (L,) index of sentence l's image. For every
    true pair (k, l): -log of exp(scale S_kl) over its sum with exp(scale S_k'l) for the other images
    k' (rank images), plus the same over the sentences l' not of k (rank sentences: the other true
    sentences of k are left out, not counted as negatives). Mean over pairs.
    """
    z = s * scale
    n_sent = s.shape[1]
    cols = torch.arange(n_sent, device=s.device)
    true = z[pair_image, cols]  # (L,)
    rank_images = torch.logsumexp(z, dim=0) - true  # a sentence has one true image
    others = pos[pair_image] & (cols[None, :] != cols[:, None])  # (L, L'): k(l)'s other sentences
    rank_sents = torch.logsumexp(z[pair_image].masked_fill(others, float("-inf")), dim=1) - true
    return (rank_images + rank_sents).mean()


def two_branch_loss(img: torch.Tensor, txt: torch.Tensor, pos: torch.Tensor, pair_image: torch.Tensor,
                    margin: float = 0.1, top_k: int = 50, lambda_img: float = 2.0,
                    lambda_struct: float = 0.1) -> torch.Tensor:
    """Bidirectional triplet loss with top-K violating negatives plus the sentence structure term.

    img: (K, h), txt: (L, h) unit vectors; distance d = ||x - y|| between unit vectors.
    Terms: sentence->image (lambda 1, the first term of the paper's Eq.), image->sentence (lambda_img),
    and structure: a sentence must be closer to the other sentences of its image than to sentences
    of other images (lambda_struct). Hinges averaged over the K most violating negatives.
    """
    d = torch.cdist(txt, img)  # (L, K)
    n_sent = txt.shape[0]
    ar = torch.arange(n_sent, device=d.device)
    d_pos = d[ar, pair_image]  # (L,)
    neg_img = ~pos.T  # (L, K)

    def topk_hinge(viol: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        viol = viol.masked_fill(~valid, float("-inf"))
        k = min(top_k, viol.shape[1])
        top = viol.topk(k, dim=1).values
        return F.relu(top).nan_to_num(0.0, neginf=0.0).mean(dim=1)

    # sentence as anchor: its image closer than other images
    l_s2i = topk_hinge(margin + d_pos[:, None] - d, neg_img).mean()
    # image as anchor: each positive sentence closer than sentences of other images
    d_img = d.T  # (K, L)
    pos_for_pair = d_img[pair_image]  # (L, L): row = anchor image of pair l, cols = all sentences
    l_i2s = topk_hinge(margin + d_pos[:, None] - pos_for_pair, ~pos[pair_image]).mean()
    # structure: sentences of the same image closer to each other than to other images' sentences
    dt = torch.cdist(txt, txt)
    same = pos[pair_image]  # (L, L) sentence l' belongs to sentence l's image
    same_wo_self = same & ~torch.eye(n_sent, dtype=torch.bool, device=same.device)
    if same_wo_self.any():
        far_pos = dt.masked_fill(~same_wo_self, float("-inf")).max(dim=1).values  # (L,)
        has = same_wo_self.any(dim=1)
        l_struct = topk_hinge(margin + far_pos[:, None] - dt, ~same)[has].mean()
    else:
        l_struct = d.new_zeros(())
    return l_s2i + lambda_img * l_i2s + lambda_struct * l_struct


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, scale: float) -> torch.Tensor:
    """Distillation of a teacher's batch scores: (K, L) S_kl of the student and of the teacher (no
    gradient), each standardised over the batch (their scales differ: the teacher sums more blocks),
    times `scale`, as logits. KL(teacher || student) of each sentence's distribution over the batch's
    images plus that of each image's distribution over the batch's sentences, means over sentences
    and over images: the student learns the teacher's ranking in both directions, soft negatives
    included, not its absolute scores."""

    def standard(s: torch.Tensor) -> torch.Tensor:
        return (s - s.mean()) / s.std().clamp_min(1e-6) * scale

    z_s, z_t = standard(student), standard(teacher.detach())
    images = F.kl_div(F.log_softmax(z_s, dim=0), F.log_softmax(z_t, dim=0), log_target=True,
                      reduction="sum") / student.shape[1]
    sentences = F.kl_div(F.log_softmax(z_s, dim=1), F.log_softmax(z_t, dim=1), log_target=True,
                         reduction="sum") / student.shape[0]
    return images + sentences
