"""The region ranker: its file, the extractor keeping the proposals it ranks first, the feature cache's key, and
its training on pictures with known boxes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from fragsearch.model.boxes import box_iou
from fragsearch.model.config import ImageConfig
from fragsearch.model.features import config_key
from fragsearch.model.image import RegionExtractor
from fragsearch.model.places import Places
from fragsearch.model.proposals import full_box, grid_boxes, select_regions, sides_at_least
from fragsearch.model.regions import GEOMETRY, RankerError, RegionRanker, geometry, load_ranker, read_ranker

FEATURES = 1280


def small_first(seed: int = 0) -> RegionRanker:
    """A ranker that prefers small boxes: its one hidden unit reads minus the log area (geometry column 6), the
    pooled features weigh nearly nothing."""
    rng = np.random.default_rng(seed)
    d = FEATURES + GEOMETRY
    w1 = np.zeros((d, 2), np.float32)
    w1[:FEATURES, 1] = rng.normal(0, 1e-3, FEATURES)
    w1[FEATURES + 6, 0] = -1.0
    return RegionRanker(np.zeros(d, np.float32), np.ones(d, np.float32), w1, np.asarray([10.0, 0.0], np.float32),
                        np.asarray([1.0, 0.0], np.float32), 0.0)


def picture() -> Image.Image:
    """A 320 x 240 picture with a few coloured shapes on a textured ground: proposals of many sizes."""
    rng = np.random.default_rng(3)
    img = Image.fromarray(rng.integers(90, 140, (240, 320, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(img)
    draw.rectangle([20, 30, 110, 140], fill=(220, 30, 30))
    draw.ellipse([170, 40, 300, 200], fill=(30, 40, 210))
    draw.rectangle([120, 160, 160, 220], fill=(240, 230, 40))
    draw.rectangle([60, 170, 90, 200], fill=(20, 200, 60))
    return img


def test_a_ranker_file_reads_back_and_is_named_by_its_content(tmp_path: Path) -> None:
    ranker = small_first()
    path = ranker.save(tmp_path)
    assert path.name == ranker.name() and path.name.startswith("region-ranker-")
    back = read_ranker(path)
    rng = np.random.default_rng(1)
    boxes = np.asarray([[0, 0, 50, 50], [10, 10, 200, 150], [0, 0, 320, 240]], np.float32)
    pooled = rng.normal(size=(3, FEATURES)).astype(np.float32)
    np.testing.assert_array_equal(back.score(pooled, boxes, 320, 240), ranker.score(pooled, boxes, 320, 240))
    assert small_first(seed=2).name() != ranker.name()
    scores = ranker.score(pooled, boxes, 320, 240)
    assert scores[0] > scores[1] > scores[2]  # the smaller, the higher
    (tmp_path / "bad.npz").write_bytes(b"not arrays")
    with pytest.raises(RankerError):
        read_ranker(tmp_path / "bad.npz")
    np.savez(tmp_path / "other.npz", form=np.asarray("something-else"))
    with pytest.raises(RankerError, match="not a region ranker"):
        read_ranker(tmp_path / "other.npz")
    with pytest.raises(RankerError, match="pooled features per box"):
        ranker.score(pooled[:, :10], boxes, 320, 240)


def test_geometry_reads_corners_sides_area_aspect_and_centre() -> None:
    g = geometry(np.asarray([[0, 0, 160, 60]], np.float32), 320, 240)[0]
    np.testing.assert_allclose(g, [0, 0, 0.5, 0.25, 0.5, 0.25, np.log(0.125), np.log(2.0), 0.25, 0.125], rtol=1e-6)


def test_a_ranker_that_is_not_there_is_an_error_at_start(tmp_path: Path) -> None:
    cfg = ImageConfig(region_features="crop", backbone_size=224, backbone_precision="int8",
                      region_ranker="region-ranker-000000000000.npz")
    with pytest.raises(FileNotFoundError, match=f"000000000000.npz is in neither .* or {re.escape(str(tmp_path))}/"):
        RegionExtractor(cfg, places=Places(tmp_path, tmp_path / "cache"))
    with pytest.raises(RankerError, match="not a region ranker's file name"):
        load_ranker("../elsewhere.npz")
    with pytest.raises(ValueError, match="selective search's proposals"):
        RegionExtractor(dataclasses.replace(cfg, proposals="detector"))


def test_the_feature_cache_key_carries_the_ranker() -> None:
    cfg = ImageConfig()
    assert config_key(dataclasses.replace(cfg, region_ranker="")) == config_key(cfg)
    one = config_key(dataclasses.replace(cfg, region_ranker="region-ranker-aaaaaaaaaaaa.npz"))
    two = config_key(dataclasses.replace(cfg, region_ranker="region-ranker-bbbbbbbbbbbb.npz"))
    assert len({config_key(cfg), one, two}) == 3


@pytest.fixture
def saved_ranker(tmp_path: Path) -> tuple[RegionRanker, str, Places]:
    """`small_first` saved where an extractor of the places returned finds it (the graph folder of a fresh
    artifacts folder), and its file name."""
    places = Places(tmp_path, tmp_path / "cache")
    ranker = small_first()
    return ranker, ranker.save(places.graphs).name, places


def crops(min_box_frac: float) -> ImageConfig:
    """Small int8 crop settings for the test pictures, with the smallest box side given."""
    return ImageConfig(region_features="crop", backbone_size=224, backbone_precision="int8",
                       min_box_frac=min_box_frac, proposal_resize=160)


def areas(boxes: np.ndarray) -> np.ndarray:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def test_the_extractor_keeps_the_proposals_the_ranker_ranks_first(saved_ranker: tuple[RegionRanker, str, Places]
                                                                  ) -> None:
    ranker, name, places = saved_ranker
    base = crops(0.06)
    ranked = dataclasses.replace(base, region_ranker=name)
    img = picture()
    extractor = RegionExtractor(ranked, places=places)
    boxes, pooled, w, h = extractor.ranked_inputs(img)
    assert len(boxes) > ranked.n_regions, "the picture has more proposals than regions: the order decides"
    want, _ = select_regions(boxes, ranker.score(pooled, boxes, w, h), w, h, ranked)
    got = extractor.extract(img)
    np.testing.assert_allclose(got.boxes, np.concatenate([full_box(w, h), want]), atol=1e-3)
    assert got.features.shape == (ranked.n_fragments, FEATURES)
    by_head = RegionExtractor(base).extract(img)
    area, head_area = areas(got.boxes[1:]), areas(by_head.boxes[1:])
    assert area[0] <= area.min() + 1e-3, "the first region is the smallest kept: the ranker's order"
    assert not np.allclose(got.boxes, by_head.boxes), "the ImageNet head ranks them otherwise"
    assert float(np.median(area)) < float(np.median(head_area))


def test_split_regions_are_the_heads_first_then_the_rankers_beside_them(
        saved_ranker: tuple[RegionRanker, str, Places]) -> None:
    ranker, name, places = saved_ranker
    head_only = crops(0.25)
    split = dataclasses.replace(head_only, min_box_frac=0.06, region_ranker=name, head_regions=5,
                                head_min_box_frac=0.25)
    img = picture()
    extractor = RegionExtractor(split, places=places)
    by_head = RegionExtractor(head_only).extract(img)
    got = extractor.extract(img)
    assert got.boxes.shape == (split.n_fragments, 4) and got.features.shape == (split.n_fragments, FEATURES)
    w, h = img.size
    grid = grid_boxes(w, h)
    assert not any(np.allclose(b, g, atol=1e-3) for b in by_head.boxes[1:6] for g in grid), \
        "the head keeps 5 proposals of its own"
    np.testing.assert_allclose(got.boxes[:6], by_head.boxes[:6], atol=1e-3,
                               err_msg="the whole image, then the head's 5 as a model without a ranker keeps them")
    # the other 14: the ranker's best (its order among every proposal), each kept unless it overlaps a box kept
    # before it (the head's included) above nms_iou, near-copies of the whole image left out
    boxes, pooled, _, _ = extractor.ranked_inputs(img)
    assert (~sides_at_least(boxes, w, h, 0.25)).sum() > 5, "there are small proposals for the free slots"
    order = np.argsort(-ranker.score(pooled, boxes, w, h), kind="stable")
    kept = [*got.boxes[1:6]]
    for row in order:
        b = boxes[row]
        if len(kept) == split.n_regions:
            break
        if box_iou(b[None], full_box(w, h))[0, 0] > 0.9 or box_iou(b[None], np.asarray(kept))[0].max() > 0.5:
            continue
        kept.append(b)
    ranked = len(kept) - 5
    assert ranked >= 5, "the ranker's proposals fill free slots (the grid the ones left)"
    np.testing.assert_allclose(got.boxes[6 : 6 + ranked], np.asarray(kept[5:]), atol=1e-3)
    area = areas(got.boxes)
    assert np.median(area[6 : 6 + ranked]) < area[1:6].min(), "the ranker's slots hold the small boxes it prefers"
    with pytest.raises(ValueError, match="head_regions"):
        RegionExtractor(dataclasses.replace(split, region_ranker=""), places=places)


def test_extraction_workers_find_their_files_where_the_parent_says(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A ranker saved only in the graph folder of the places the pool is given (a command's flags): the spawned
    workers find it there, not in the folder their environment names."""
    from fragsearch.model.extraction import ExtractionPool

    monkeypatch.setenv("FRAGSEARCH_ARTIFACTS", str(tmp_path / "environment"))
    paths = []
    for k in range(4):
        paths.append(tmp_path / f"picture-{k}.png")
        picture().rotate(90 * k, expand=True).save(paths[-1])
    places = Places(tmp_path / "flags", tmp_path / "flags" / "cache")
    name = small_first().save(places.graphs).name
    cfg = dataclasses.replace(crops(0.06), region_ranker=name)
    (tmp_path / "entries").mkdir()
    with ExtractionPool(cfg, workers=2, places=places) as pool:
        done, failed = pool.run(paths, batch=1, out_dir=tmp_path / "entries", progress=False)
    assert (done, failed) == (4, [])
    assert not (tmp_path / "environment" / "cache" / "graphs" / name).exists()


def test_the_feature_cache_key_carries_the_split() -> None:
    ranked = ImageConfig(region_ranker="region-ranker-0123456789ab.npz")
    assert config_key(dataclasses.replace(ranked, head_regions=12)) != config_key(ranked)
    assert config_key(dataclasses.replace(ranked, head_regions=12)) != config_key(
        dataclasses.replace(ranked, head_regions=12, head_min_box_frac=0.2))
    assert config_key(dataclasses.replace(ranked, head_min_box_frac=0.2)) == config_key(ranked), \
        "the head's floor alone changes nothing"


def test_the_ranker_learns_which_proposals_hold_the_named_boxes() -> None:
    from fragsearch.training.regions import Picture, fit_ranker, held

    rng = np.random.default_rng(0)
    cfg = ImageConfig(n_regions=3, min_box_frac=0.0)

    def pictures(n: int) -> list[Picture]:
        out = []
        for _ in range(n):
            x0 = rng.uniform(0, 150, (40, 1))
            y0 = rng.uniform(0, 150, (40, 1))
            side = rng.uniform(20, 90, (40, 1))
            boxes = np.concatenate([x0, y0, x0 + side, y0 + side], axis=1).astype(np.float32)
            pooled = rng.normal(size=(40, 16)).astype(np.float32)
            named = rng.choice(40, 3, replace=False)
            pooled[named, :4] += 3.0  # what a named box looks like: its first features stand out
            chains: list[tuple[np.ndarray, int, tuple[str, ...]]] = [(boxes[k : k + 1], 1, ("people",)) for k in named]
            out.append(Picture(boxes, pooled.astype(np.float16), 256, 256, chains))
        return out

    train, val = pictures(600), pictures(60)
    ranker, report = fit_ranker(train, val, cfg, hidden=8, epochs=6)
    chance = held(val, (rng.normal(size=len(p.boxes)) for p in val), cfg)["all"]
    learnt = held(val, (ranker.score(p.pooled, p.boxes, p.width, p.height) for p in val), cfg)["all"]
    assert chance < 40.0, "a random order keeps few of the named boxes: the margin below is real"
    assert learnt >= 80.0 and learnt >= chance + 30.0
    assert report["epoch"] in range(1, 7) and len(report["history"]) == 6
