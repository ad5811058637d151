"""A model whose regions carry the COCO detector's class scores, over one real Flickr8K photo of two dogs: the
regions the detector finds are named "dog", the whole image and the selective-search top-up slots are not.
Shared by the tests of labels in the index and API (tests/test_detector.py) and on the page (tests/test_browser.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig, TextConfig
from fragsearch.model.encoders import ModelConfig
from fragsearch.model.features import feature_dim
from fragsearch.model.fragments import TextPipeline
from fragsearch.model.text import RelationVocab
from fragsearch.model.words import WordTable
from fragsearch.settings import default_data_dir
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel

DOG = "1001773457_577c3a7d70.jpg"  # two dogs playing (Flickr8K train): the detector finds both
DOG_SENTENCE = "two brown dogs play on the grass"
LABELLED_CFG = ImageConfig(region_features="crop", backbone_precision="int8", min_box_frac=0.25, proposal_resize=112,
                           backbone_size=224, proposals="detector_topup", detector_floor=0.5, detector_classes=True)


def dog_photo_path() -> Path:
    """The Flickr8K photo of two dogs (the test is skipped where the data set is not beside the project)."""
    path = default_data_dir() / "images" / DOG
    if not path.is_file():
        pytest.skip(f"the Flickr8K photo {path} is not here")
    return path


def dog_photo() -> np.ndarray:
    return np.asarray(Image.open(dog_photo_path()).convert("RGB"))


def labelled_bundle() -> Bundle:
    """An untrained (seeded) model at h = 16 over LABELLED_CFG's features, with the words of DOG_SENTENCE."""
    words = WordTable.build(["a", "dog", "dogs", "brown", "play", "grass", "on", "the", "two"])
    relations = RelationVocab(["det", "amod", "nsubj", "num", "prep_on"], {}, 0.01)
    torch.manual_seed(0)
    model = FragmentModel(ModelConfig(h=16, img_dim=feature_dim(LABELLED_CFG), n_relations=len(relations)))
    return Checkpoint(model.eval(), TextPipeline(TextConfig(), relations, words), LABELLED_CFG).bundle()


def dog_index(root: Path, bundle: Bundle, photo: Path | None = None) -> tuple[ImageIndex, int]:
    """An index at `root` (the candidate stage on: exact_below 0) holding the dog photo, extracted here with the
    real detector; stored under `photo` (a path the index serves the file from, if it exists) → (index, its id)."""
    image = Image.fromarray(dog_photo())
    index = ImageIndex.create(root, bundle, IndexSettings.of(exact_below=0, k_prime=4096))
    [image_id] = index.add([image], [DOG], [photo or root.parent / DOG], read_places=False)
    return index, image_id
