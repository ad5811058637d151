"""Dependency trees as arrays, and batches of them scheduled by height for the tree RNNs (SPEC.md §2).

A sentence's tree (``SentenceTree``) has one node per token: the pool row of its fixed word vector
(-1 for a word without one: it adds no word term but keeps its place and its children), its head
(-1 for the root), its relation id (SDT-RNN) and its signed position among its head's children
(DT-RNN: -1 = l1, the nearest left child; +2 = r2, the second nearest right child). ``size`` is
ℓ(i), the number of words under node i (itself included); ``height`` is 0 for a leaf and one more
than its highest child otherwise, so a node's children are all computed before it when nodes are
taken height by height: ``TreeBatch`` lists, per height, the nodes and the edges into them.

A parse with several roots (a caption of two sentences) is made one tree: the later roots become
children of the first (relation ``ROOT``): the sentence vector is the first root's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SentenceTree:
    """One sentence's tree; every array (n,), n = its number of tokens."""

    rows: np.ndarray  # pool row of each node's word vector, -1 for none
    heads: np.ndarray  # head node, -1 for the root
    rel: np.ndarray  # relation id of the edge to the head (SDT-RNN)
    pos: np.ndarray  # signed position among the head's children, nearest first (DT-RNN); 0 for the root
    size: np.ndarray  # ℓ(i): words under node i, itself included
    height: np.ndarray  # 0 for leaves

    @property
    def root(self) -> int:
        """The root node, -1 for an empty sentence."""
        roots = np.flatnonzero(self.heads < 0)
        return int(roots[0]) if len(roots) else -1

    @classmethod
    def build(cls, rows: Sequence[int], heads: Sequence[int], rel: Sequence[int], root_rel: int) -> SentenceTree:
        """A tree from per-token word rows, heads (-1 = root; assumed acyclic) and relation ids;
        `root_rel` is the relation of a later root attached to the first."""
        n = len(rows)
        h = np.asarray(heads, dtype=np.int64).reshape(n)
        r = np.asarray(rel, dtype=np.int64).reshape(n).copy()
        roots = np.flatnonzero(h < 0)
        if len(roots) > 1:
            h = h.copy()
            h[roots[1:]] = roots[0]
            r[roots[1:]] = root_rel
        pos = np.zeros(n, dtype=np.int64)
        for parent in range(n):
            kids = np.flatnonzero(h == parent)
            left = sorted((k for k in kids if k < parent), reverse=True)  # nearest first
            right = sorted(k for k in kids if k > parent)
            for rank, k in enumerate(left, 1):
                pos[k] = -rank
            for rank, k in enumerate(right, 1):
                pos[k] = rank
        depth = np.zeros(n, dtype=np.int64)
        for i in range(n):
            node, d = i, 0
            while h[node] >= 0:
                node, d = int(h[node]), d + 1
                if d > n:
                    raise ValueError("the heads do not form a tree (a cycle)")
            depth[i] = d
        size = np.ones(n, dtype=np.int64)
        height = np.zeros(n, dtype=np.int64)
        for i in np.argsort(-depth, kind="stable"):  # deepest first: children before their head
            if h[i] >= 0:
                size[h[i]] += size[i]
                height[h[i]] = max(height[h[i]], height[i] + 1)
        return cls(np.asarray(rows, dtype=np.int64).reshape(n), h, r, pos, size, height)


@dataclass
class TreeLevel:
    """The nodes of one height and the edges into them: child node, index of the parent in `nodes`,
    relation id and signed position of each edge (all (E,))."""

    nodes: Any  # NumPy arrays (the runtime), torch tensors (training: `TreeBatch.to`)
    child: Any
    parent: Any
    rel: Any
    pos: Any


@dataclass
class TreeBatch:
    """L sentences' trees as one forest of N nodes.

    rows: (N,) pool rows (-1: no word vector); sent_of: (N,) sentence of each node; size: (N,) ℓ as
    float; levels: heights 0, 1, ... in order; root: (L,) root node of each sentence (-1: empty)."""

    rows: Any
    sent_of: Any
    size: Any
    levels: list[TreeLevel]
    root: Any

    @property
    def n_sentences(self) -> int:
        return int(self.root.shape[0])

    @classmethod
    def of(cls, trees: Sequence[SentenceTree], device: Any = None) -> TreeBatch:
        """The forest of `trees` as NumPy arrays, or as torch tensors on `device` when one is given (training)."""
        lengths = np.array([len(t.rows) for t in trees], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

        def cat(name: str) -> np.ndarray:
            parts = [getattr(t, name) for t in trees]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)

        heads = cat("heads")
        node_off = np.repeat(offsets, lengths)
        heads = np.where(heads >= 0, heads + node_off, -1)
        height, rel, pos = cat("height"), cat("rel"), cat("pos")
        root = np.array([t.root + o if t.root >= 0 else -1 for t, o in zip(trees, offsets, strict=True)],
                        dtype=np.int64)
        levels = []
        child_all = np.flatnonzero(heads >= 0)
        for level in range(int(height.max()) + 1 if len(height) else 0):
            nodes = np.flatnonzero(height == level)
            local = np.full(len(heads), -1, dtype=np.int64)
            local[nodes] = np.arange(len(nodes))
            child = child_all[height[heads[child_all]] == level]
            levels.append(TreeLevel(nodes, child, local[heads[child]], rel[child], pos[child]))
        batch = cls(cat("rows"), np.repeat(np.arange(len(trees), dtype=np.int64), lengths),
                    cat("size").astype(np.float32), levels, root)
        return batch if device is None else batch.to(device)

    def to(self, device: Any) -> TreeBatch:
        """The same forest as torch tensors on `device` (training; imports torch)."""
        import torch

        def t(a: Any) -> Any:
            return (torch.from_numpy(a) if isinstance(a, np.ndarray) else a).to(device)

        levels = [TreeLevel(*(t(getattr(lv, f)) for f in ("nodes", "child", "parent", "rel", "pos")))
                  for lv in self.levels]
        return TreeBatch(t(self.rows), t(self.sent_of), t(self.size), levels, t(self.root))

    def with_rows(self, rows: np.ndarray) -> TreeBatch:
        """The same forest reading its word vectors from other pool rows (-1 kept where there was none)."""
        return TreeBatch(np.where(self.rows >= 0, rows, -1), self.sent_of, self.size, self.levels, self.root)


def position_ranges(trees: Sequence[SentenceTree]) -> tuple[int, int]:
    """The most left and right children any node has: how many position matrices the DT-RNN needs."""
    left = max((int(-t.pos.min()) for t in trees if len(t.pos)), default=0)
    right = max((int(t.pos.max()) for t in trees if len(t.pos)), default=0)
    return max(left, 0), max(right, 0)
