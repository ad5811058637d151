"""A model's fingerprint (index/fingerprint.py) names the weights and settings behind an index's
vectors: a setting added to the model or image configuration later must leave the fingerprint of a
model that keeps its default unchanged, or every index built before it would be refused at load."""

from __future__ import annotations

import dataclasses

import numpy as np

from fragsearch.index.fingerprint import model_fingerprint
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Calibration
from fragsearch.model.words import WordTable
from tests.test_index import WORDS, make_bundle

# the fingerprint of make_bundle over fixed word vectors (MiniLM's vectors of WORDS differ in their last
# bits from one CPU to another, so the table is not built here) as the code before merged models
# (blocks) and the crops' CNN (backbone) were settings computed it: the value its indexes carry
BEFORE_BLOCKS_AND_BACKBONE = "b9176466ad87be67bbd1"


def fixed_words() -> WordTable:
    vectors = (np.arange(len(WORDS) * 384, dtype=np.float32).reshape(len(WORDS), 384) % 97) / 97.0
    return WordTable(WORDS, vectors)


def test_a_model_at_the_later_settings_defaults_keeps_its_earlier_fingerprint() -> None:
    assert model_fingerprint(make_bundle(fixed_words())) == BEFORE_BLOCKS_AND_BACKBONE


def test_the_later_settings_change_the_fingerprint_when_used() -> None:
    base = make_bundle(WordTable.build(WORDS))
    blocks = make_bundle(WordTable.build(WORDS))
    blocks.encoders.cfg = dataclasses.replace(blocks.encoders.cfg, blocks=2)
    lite2 = Bundle(base.encoders, base.text, dataclasses.replace(base.image_cfg, backbone="efficientnet-lite2"))
    detector = Bundle(base.encoders, base.text, dataclasses.replace(base.image_cfg, proposals="detector"))
    classes = Bundle(base.encoders, base.text, dataclasses.replace(detector.image_cfg, detector_classes=True))
    side = Bundle(base.encoders, base.text, dataclasses.replace(base.image_cfg, decode_side=0))
    ranked = Bundle(base.encoders, base.text, dataclasses.replace(base.image_cfg,
                                                                  region_ranker="region-ranker-0123456789ab.npz"))
    one_pass = make_bundle(WordTable.build(WORDS))
    one_pass.text.cfg = dataclasses.replace(one_pass.text.cfg, sentence_pass="words")
    local = make_bundle(WordTable.build(WORDS))
    g = np.random.default_rng(0)
    mask = np.ones((6, 3), np.float32)
    plain = Calibration(g.random((5, 4, base.dim), dtype=np.float32), g.random((6, 3, base.dim), dtype=np.float32),
                        mask, 1e-3, 1e-3)
    local.calibration = plain.localised(3, 0.75)
    seen = {model_fingerprint(b) for b in (base, blocks, lite2, detector, classes, side, ranked, one_pass, local)}
    assert len(seen) == 9
    spread_only = make_bundle(WordTable.build(WORDS))
    spread_only.calibration = plain  # the spread alone keeps the fingerprint the indexes were built with
    assert model_fingerprint(spread_only) == model_fingerprint(base)
