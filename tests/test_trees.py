"""The tree RNNs and DeViSE: composition against the paper's formula written out by hand, batching,
the trees the parser gives, and the word-mean sentence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.parsers import SpacyParser
from fragsearch.model.trees import SentenceTree, TreeBatch, position_ranges
from fragsearch.training.nets.encoders import DeViSE, TreeRNN, arrays
from fragsearch.training.objectives import global_loss

D, H = 3, 2


def _tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(x)


def _set(model: TreeRNN, wv: np.ndarray, mats: list[np.ndarray]) -> None:
    with torch.no_grad():
        model.word.weight.copy_(torch.tensor(wv, dtype=torch.float32))
        model.child.copy_(torch.tensor(np.stack(mats), dtype=torch.float32))


def _embed(model: TreeRNN | DeViSE, pool: np.ndarray, trees: list[SentenceTree]) -> np.ndarray:
    """The sentence vectors of the torch module (training's) and of the runtime's NumPy encoders over its
    weights, checked to agree; the torch module's returned."""
    with torch.no_grad():
        out = model.embed_sentences(torch.tensor(pool, dtype=torch.float32), TreeBatch.of(trees, "cpu")).numpy()
    runtime = Encoders(model.cfg, arrays(model)).embed_trees(np.asarray(pool, np.float32), TreeBatch.of(trees))
    np.testing.assert_allclose(runtime, out, rtol=1e-5, atol=1e-6)
    return out


# "Students ride bikes at night" (the paper's running example, Fig. 3): edges (child, parent) =
# (1, 2), (2, 0), (3, 2), (4, 2), (5, 4) in its 1-based numbering
HEADS = [1, -1, 1, 1, 3]
X = np.array([[1.0, 0.0, 2.0], [0.5, -1.0, 0.0], [0.0, 1.0, 1.0], [-1.0, 0.5, 0.5], [2.0, 0.0, -1.0]])
WV = np.array([[0.3, -0.2, 0.1], [0.0, 0.4, -0.5]])
WL1 = np.array([[0.9, -0.3], [0.2, 0.7]])
WR1 = np.array([[-0.4, 0.8], [0.5, 0.1]])
WR2 = np.array([[0.6, 0.6], [-0.7, 0.3]])


def test_dt_rnn_composes_the_papers_running_example_as_its_equation_4() -> None:
    # written out from Eq. 4: h_i = tanh((W_v x_i + sum_j l(j) W_pos(i,j) h_j) / l(i)), l(i) = words under i
    h1 = _tanh(WV @ X[0])  # Students: a leaf, l = 1
    h3 = _tanh(WV @ X[2])  # bikes
    h5 = _tanh(WV @ X[4])  # night
    h4 = _tanh((WV @ X[3] + 1 * WR1 @ h5) / 2)  # at: night is its first right child; l(at) = 2
    h2 = _tanh((WV @ X[1] + 1 * WL1 @ h1 + 1 * WR1 @ h3 + 2 * WR2 @ h4) / 5)  # ride: l1, r1, r2; l = 5
    tree = SentenceTree.build(list(range(5)), HEADS, [0] * 5, root_rel=0)
    assert position_ranges([tree]) == (1, 2)
    assert tree.size.tolist() == [1, 5, 1, 2, 1] and tree.root == 1
    model = TreeRNN(ModelConfig(kind="dt-rnn", word_dim=D, h=H, tree_left=1, tree_right=2))
    _set(model, WV, [WL1, WR1, WR2])  # l1, then r1, r2
    np.testing.assert_allclose(_embed(model, X, [tree])[0], h2, rtol=1e-5, atol=1e-6)


def test_sdt_rnn_takes_the_matrix_of_each_edges_relation() -> None:
    # relations: nsubj (Students), dobj (bikes), prep (at), pobj (night) -> ids 0, 1, 2, 1 (pobj shares dobj's)
    rels = [0, 0, 1, 2, 1]
    w = [WL1, WR1, WR2]
    h1 = _tanh(WV @ X[0])
    h3 = _tanh(WV @ X[2])
    h5 = _tanh(WV @ X[4])
    h4 = _tanh((WV @ X[3] + w[1] @ h5) / 2)
    h2 = _tanh((WV @ X[1] + w[0] @ h1 + w[1] @ h3 + 2 * w[2] @ h4) / 5)
    model = TreeRNN(ModelConfig(kind="sdt-rnn", word_dim=D, h=H, n_relations=3))
    _set(model, WV, w)
    tree = SentenceTree.build(list(range(5)), HEADS, rels, root_rel=0)
    np.testing.assert_allclose(_embed(model, X, [tree])[0], h2, rtol=1e-5, atol=1e-6)


def test_a_child_past_the_trained_positions_is_passed_through_unchanged_and_unknown_words_add_nothing() -> None:
    # root 0 with right children 1, 2, 3; the model knows r1 and r2 only: r3 uses the identity
    x = X[:4]
    h1, h2 = _tanh(WV @ x[1]), _tanh(WV @ x[2])
    h3 = _tanh(np.zeros(H))  # word 3 has no vector: W_v x = 0
    want = _tanh((WV @ x[0] + WR1 @ h1 + WR2 @ h2 + h3) / 4)
    model = TreeRNN(ModelConfig(kind="dt-rnn", word_dim=D, h=H, tree_left=1, tree_right=2))
    _set(model, WV, [WL1, WR1, WR2])
    tree = SentenceTree.build([0, 1, 2, -1], [-1, 0, 0, 0], [0] * 4, root_rel=0)
    np.testing.assert_allclose(_embed(model, x, [tree])[0], want, rtol=1e-5, atol=1e-6)


def test_a_batch_of_trees_gives_each_sentence_its_own_vector() -> None:
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(12, D))
    trees = [SentenceTree.build(list(range(5)), HEADS, [0, 0, 1, 2, 1], root_rel=0),
             SentenceTree.build([], [], [], root_rel=0),  # no words
             SentenceTree.build([5, 6, 7], [-1, 0, -1], [1, 2, 0], root_rel=2),  # two roots: one tree
             SentenceTree.build([8, 9, 10, 11], [1, 2, -1, 2], [0, 1, 2, 0], root_rel=0)]
    assert trees[2].heads.tolist() == [-1, 0, 0] and trees[2].rel.tolist() == [1, 2, 2]
    for kind in ("dt-rnn", "sdt-rnn"):
        torch.manual_seed(0)
        model = TreeRNN(ModelConfig(kind=kind, word_dim=D, h=4, n_relations=3, tree_left=1, tree_right=2))
        batched = _embed(model, pool, trees)
        assert np.all(batched[1] == 0)
        for i, t in enumerate(trees):
            np.testing.assert_allclose(batched[i], _embed(model, pool, [t])[0], rtol=1e-5, atol=1e-6)


def test_devise_sentence_is_the_normalised_mean_of_its_known_words() -> None:
    model = DeViSE(ModelConfig(kind="devise", word_dim=D, h=D, img_dim=5))
    tree = SentenceTree.build([0, -1, 2], [-1, 0, 0], [0, 0, 0], root_rel=0)
    mean = (X[0] + X[2]) / 2
    np.testing.assert_allclose(_embed(model, X, [tree])[0], mean / np.linalg.norm(mean), rtol=1e-5)
    with pytest.raises(ValueError, match="word-vector space"):
        DeViSE(ModelConfig(kind="devise", word_dim=D, h=4))


def test_devise_loss_ranks_sentences_for_an_image_and_eq5_both_ways() -> None:
    s = torch.tensor([[3.0, 1.0, 2.5], [2.0, 0.0, 1.0]])  # images x sentences; sentence 0 of image 0, 1 and 2 of 1
    pair = torch.tensor([0, 1, 1])
    pos = pair[None, :] == torch.arange(2)[:, None]
    m = 1.0
    # image -> its sentences only (DeViSE): pair (0,0): sentences 1, 2 of image 1; pairs (1,1), (1,2): sentence 0
    sents = [max(0, m - 3 + 1) + max(0, m - 3 + 2.5), max(0, m - 0 + 2), max(0, m - 1 + 2)]
    # sentence -> images (the other direction of Eq. 5): the one other image of each pair
    imgs = [max(0, m - 3 + 2), max(0, m - 0 + 1), max(0, m - 1 + 2.5)]
    assert float(global_loss(s, pos, pair, m, rank_images=False)) == pytest.approx(np.mean(sents))
    assert float(global_loss(s, pos, pair, m)) == pytest.approx(np.mean(np.add(sents, imgs)))


@pytest.fixture(scope="module")
def parser() -> SpacyParser:
    return SpacyParser()


@pytest.mark.parametrize("sentence", ["A dog jumps out of the water .", "The child was hugged by its mother",
                                      "Two dogs play in the snow . A man watches them"])
def test_the_tree_is_the_collapsed_parse_the_triplets_come_from(parser: SpacyParser, sentence: str) -> None:
    p = parser.parse([sentence])[0]
    assert len(p.heads) == len(p.labels) == len(p.tokens)
    edges = {(t.rel, t.w1, t.w2) for t in p.tree_edges()}
    assert {(t.rel, t.w1, t.w2) for t in p.triplets} <= edges  # every triplet is an edge of the tree
    tree = SentenceTree.build(list(range(len(p.tokens))), p.heads, [0] * len(p.tokens), root_rel=0)
    assert int(tree.size[tree.root]) == len(p.tokens)  # one tree over every word
    prep = [i for i, lab in enumerate(p.labels) if lab.startswith(("prep_", "agent"))]
    assert prep  # a collapsed preposition: its word hangs below the object as "case"
    for i in prep:
        assert any(p.labels[c] == "case" and p.heads[c] == i for c in range(len(p.tokens)))
