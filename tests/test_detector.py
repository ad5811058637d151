"""The COCO detector (model/detector.py) and detector proposals (model/proposals.py, model/image.py): its files
checked by hash, the decoding against OpenCV's own output layer, class-agnostic NMS, and regions from it on a
real Flickr8K photo."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from fragsearch.index import ImageIndex
from fragsearch.model.config import ImageConfig
from fragsearch.model.detector import (
    COCO_LABELS,
    DETECTOR_FILES,
    N_CLASSES,
    Detections,
    Detector,
    DetectorMissing,
    check_files,
    detector_dir,
    label_of,
    select,
)
from fragsearch.model.features import config_key, feature_dim
from fragsearch.model.image import RegionExtractor, fragment_classes, image_proposals
from fragsearch.model.proposals import PROPOSAL_COLUMNS, proposal_columns, select_regions
from fragsearch.service.routes.convert import match_out, region_result
from tests import labelled


@pytest.fixture(scope="module")
def detector() -> Detector:
    return Detector()


@pytest.fixture(scope="module")
def dog_photo() -> np.ndarray:
    return labelled.dog_photo()


def test_labels_are_coco_ids_1_to_90() -> None:
    assert N_CLASSES == 90 and len([n for n in COCO_LABELS if n]) == 80
    assert COCO_LABELS[0] == "person" and COCO_LABELS[17] == "dog" and COCO_LABELS[89] == "toothbrush"


def test_files_are_checked_by_hash(tmp_path: Path) -> None:
    src = detector_dir()
    assert check_files(src).keys() == DETECTOR_FILES.keys()
    (tmp_path / "frozen_inference_graph.pb").symlink_to(src / "frozen_inference_graph.pb")
    with pytest.raises(DetectorMissing, match="ssd_mobilenet_v2_coco_2018_03_29.pbtxt is missing"):
        Detector(tmp_path)
    text = bytearray((src / "ssd_mobilenet_v2_coco_2018_03_29.pbtxt").read_bytes())
    text[-2] ^= 1
    (tmp_path / "ssd_mobilenet_v2_coco_2018_03_29.pbtxt").write_bytes(bytes(text))
    with pytest.raises(DetectorMissing, match="pbtxt is not the pinned one"):
        Detector(tmp_path)
    shutil.copy(src / "ssd_mobilenet_v2_coco_2018_03_29.pbtxt", tmp_path)
    assert isinstance(Detector(tmp_path), Detector)


def test_decoding_matches_the_graphs_own_output_layer(detector: Detector, dog_photo: np.ndarray) -> None:
    """The boxes decoded here from the raw outputs are those of the graph's DetectionOutput layer (which
    runs per-class NMS): its five best detections are among ours, same box, same class, same score."""
    boxes, scores = detector.raw(dog_photo)
    blob = cv2.dnn.blobFromImage(dog_photo, size=(300, 300), swapRB=False, crop=False)
    detector.net.setInput(blob)
    out = detector.net.forward("detection_out")[0, 0]  # (100, 7): image, class, score, x0, y0, x1, y1
    for row in out[:5]:
        cls, score = int(row[1]), float(row[2])
        k = int(np.argmin(np.abs(boxes - row[3:7]).sum(axis=1) + np.abs(scores[:, cls - 1] - score)))
        assert np.allclose(boxes[k], row[3:7], atol=1e-5)
        assert scores[k, cls - 1] == pytest.approx(score, abs=1e-6)


def test_detects_the_dogs(detector: Detector, dog_photo: np.ndarray) -> None:
    found = detector.detect(dog_photo, floor=0.5)
    assert [found.label(k) for k in range(len(found))] == ["dog", "dog"]
    assert (np.diff(found.scores) <= 0).all()
    h, w = dog_photo.shape[:2]
    assert (found.boxes >= 0).all() and (found.boxes[:, 2] <= w).all() and (found.boxes[:, 3] <= h).all()
    assert np.array_equal(found.boxes, np.round(found.boxes))  # whole pixels


def test_select_is_class_agnostic_and_breaks_ties_by_prior() -> None:
    boxes = np.asarray([[0.1, 0.1, 0.5, 0.5], [0.11, 0.1, 0.5, 0.5], [0.6, 0.6, 0.9, 0.9], [0.6, 0.1, 0.9, 0.4],
                        [0.0, 0.6, 0.3, 0.9]], np.float32)
    scores = np.zeros((5, N_CLASSES), np.float32)
    scores[0, 0] = 0.8  # person
    scores[1, 17] = 0.9  # dog, on the same place: suppresses the person although another class
    scores[2, 0] = 0.7
    scores[3, 5] = 0.70001  # a tie with box 2 at 1e-4: the earlier prior first
    scores[4, 2] = 0.05  # under the floor
    found = select(boxes, scores, 100, 100, floor=0.1, nms_iou=0.5, limit=10)
    assert isinstance(found, Detections)
    assert found.classes.tolist() == [18, 1, 6]
    assert found.boxes.tolist() == [[11, 10, 50, 50], [60, 60, 90, 90], [60, 10, 90, 40]]
    assert select(boxes, scores, 100, 100, floor=0.1, nms_iou=0.5, limit=1).classes.tolist() == [18]
    assert found.class_scores.shape == (3, N_CLASSES)
    assert np.array_equal(found.class_scores.max(axis=1), found.scores)  # every class's score, the best one's too
    assert found.class_scores[0, 17] == pytest.approx(0.9) and found.class_scores[2, 5] == pytest.approx(0.7)
    assert len(select(boxes, scores, 100, 100, floor=0.95, nms_iou=0.5, limit=10)) == 0


def test_detector_regions(dog_photo: np.ndarray) -> None:
    """proposals "detector": the regions are the detections, best first; "detector_topup": the detections over
    the floor first, then selective search's boxes fill the other slots."""
    image = Image.fromarray(dog_photo)
    base = ImageConfig(region_features="crop", backbone_precision="int8", min_box_frac=0.25, proposal_resize=112,
                       backbone_size=224)
    det = RegionExtractor(dataclasses.replace(base, proposals="detector"))
    assert det.detector is not None
    frags = det.extract(image)
    assert frags.features.shape == (base.n_fragments, 1280)
    found = det.detector.detect(dog_photo, floor=0.01)
    assert np.array_equal(frags.boxes[1:3], found.boxes[:2])
    topup = dataclasses.replace(base, proposals="detector_topup", detector_floor=0.5)
    props = image_proposals(image, topup, det.detector)
    assert props.shape[1] == 5 and np.allclose(props[:2, 4], found.scores[:2]) and np.isnan(props[2:, 4]).all()
    frags = RegionExtractor(topup).extract(image)
    assert np.array_equal(frags.boxes[1:3], found.boxes[:2])
    assert not np.array_equal(frags.boxes[3], found.boxes[2])  # a selective-search box, not the third detection
    plain = RegionExtractor(base).extract(image)
    assert np.array_equal(plain.features[0], frags.features[0])  # the whole image does not depend on the regions


def test_feature_cache_key_names_the_source() -> None:
    base = ImageConfig()
    assert config_key(base) == config_key(dataclasses.replace(base, detector_floor=0.7))  # unused: same key
    det = dataclasses.replace(base, proposals="detector")
    assert config_key(det) != config_key(base)
    assert config_key(det) == config_key(dataclasses.replace(det, detector_floor=0.7))
    topup = dataclasses.replace(base, proposals="detector_topup")
    assert len({config_key(topup), config_key(dataclasses.replace(topup, detector_floor=0.7)), config_key(det)}) == 3


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="proposals must be one of"):
        RegionExtractor(ImageConfig(proposals="yolo"))


def test_a_region_is_named_by_its_confident_class() -> None:
    scores = np.zeros(N_CLASSES, np.float32)
    assert label_of(scores) is None  # a box the detector did not propose
    scores[17] = 0.49
    assert label_of(scores) is None  # not confident
    scores[17] = 0.84
    assert label_of(scores) == "dog"
    scores[0] = 0.84
    assert label_of(scores) == "person"  # a tie: the lower category id
    with pytest.raises(ValueError, match="class scores must be"):
        label_of(np.zeros(80, np.float32))


def test_kept_regions_know_the_proposal_they_came_from() -> None:
    cfg = ImageConfig(n_regions=4)
    boxes = np.asarray([[0, 0, 100, 100], [10, 10, 40, 40], [11, 10, 40, 40], [50, 50, 90, 90]], np.float32)
    regions, rows = select_regions(boxes, np.asarray([0.9, 0.8, 0.7, 0.6], np.float32), 100, 100, cfg)
    assert rows.tolist() == [1, 3, -1, -1]  # the whole-image copy dropped, box 2 suppressed by box 1, grid after
    assert np.array_equal(regions[:2], boxes[[1, 3]])


def test_fragment_classes_are_each_regions_own_and_the_image_takes_the_largest() -> None:
    props = np.zeros((3, PROPOSAL_COLUMNS + N_CLASSES), np.float32)
    props[0, PROPOSAL_COLUMNS + 17] = 0.9  # a dog
    props[1, PROPOSAL_COLUMNS + 0] = 0.6  # a person
    props[1, PROPOSAL_COLUMNS + 17] = 0.2
    props[2, 4] = np.nan  # selective search's box: unscored, no classes
    table = fragment_classes(props, np.asarray([1, 0, 2, -1]))
    assert table.shape == (5, N_CLASSES)
    assert [label_of(row) for row in table] == ["dog", "person", "dog", None, None]
    assert table[0, 17] == pytest.approx(0.9) and table[0, 0] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="without class scores"):
        fragment_classes(props[:, :PROPOSAL_COLUMNS], np.asarray([0]))


def test_detector_classes_ride_beside_the_cnn_features(dog_photo: np.ndarray) -> None:
    """With detector_classes each fragment's features are its 1280 CNN values, the same as without, then its
    90 class scores: the two dogs are labelled, the selective-search slots carry none."""
    image = Image.fromarray(dog_photo)
    topup = ImageConfig(region_features="crop", backbone_precision="int8", min_box_frac=0.25, proposal_resize=112,
                        backbone_size=224, proposals="detector_topup", detector_floor=0.5)
    classes = dataclasses.replace(topup, detector_classes=True)
    assert feature_dim(topup) == 1280 and feature_dim(classes) == 1280 + N_CLASSES
    assert proposal_columns(topup) == 5 and proposal_columns(classes) == 5 + N_CLASSES
    assert config_key(classes) != config_key(topup)
    frags = RegionExtractor(classes).extract(image)
    plain = RegionExtractor(topup).extract(image)
    assert frags.features.shape == (topup.n_fragments, 1280 + N_CLASSES)
    assert np.array_equal(frags.boxes, plain.boxes)
    assert np.array_equal(frags.features[:, :1280], plain.features)
    labels = [label_of(row) for row in frags.features[:, 1280:]]
    assert labels[:3] == ["dog", "dog", "dog"]  # the whole image, then the two detections
    assert set(labels[3:]) == {None}
    with pytest.raises(ValueError, match="detector_classes needs the detector's regions"):
        RegionExtractor(ImageConfig(detector_classes=True))


def test_region_labels_travel_from_the_detector_to_the_api(dog_photo: np.ndarray, tmp_path: Path) -> None:
    """A model whose regions carry the detector's classes: the dog photo indexed (the candidate stage on), its
    regions' labels in the record, the search's and explanation's alignment, the region search, after a reload
    from the catalogue, and in the API's answers; the whole image and the top-up slots stay unnamed."""
    cfg = labelled.LABELLED_CFG
    bundle = labelled.labelled_bundle()
    index, image_id = labelled.dog_index(tmp_path / "images", bundle)
    record = index.get(image_id)
    assert record is not None and len(record.labels) == cfg.n_fragments
    assert record.labels[:3] == (None, "dog", "dog") and set(record.labels[3:]) == {None}

    def as_recorded(found: list[tuple[int, str | None]]) -> None:
        assert found and all(label == record.labels[i] for i, label in found)

    sentence = labelled.DOG_SENTENCE
    hit = index.search(sentence, 1).hits[0]
    as_recorded([(m.fragment, m.label) for m in hit.alignment])
    explained = index.explain(image_id, sentence)
    assert explained is not None
    as_recorded([(p.fragment, p.label) for p in explained.pairs])
    assert {p.label for p in explained.pairs} == {None, "dog"}
    regions = index.search_fragments("brown dog", cfg.n_fragments).hits
    as_recorded([(r.fragment, r.label) for r in regions])
    index.save()
    index.close()

    again = ImageIndex.load(tmp_path / "images", bundle)
    assert again.get(image_id) == record
    assert again.search(sentence, 1).hits[0].alignment == hit.alignment
    assert [match_out(m).label for m in hit.alignment] == [m.label for m in hit.alignment]
    assert [region_result(r).label for r in again.search_fragments("brown dog", cfg.n_fragments).hits] == \
        [r.label for r in regions]
    again.close()
