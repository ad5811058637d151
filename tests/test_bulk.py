"""Bulk extraction into fragment shards (index/bulk.py, index/shards.py): the local engine and the shard
writer / loader on real pictures (fast); the Ray engine against the plain extractor (slow: Ray's start-up)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from fragsearch.index import ImageIndex, IndexSettings, list_images
from fragsearch.index.bulk import bulk_extract
from fragsearch.index.shards import (
    FAILED_FILE,
    ShardError,
    ShardWriter,
    done_paths,
    load_shards,
    read_shard,
    shard_files,
    shard_settings,
)
from fragsearch.model.config import ImageConfig
from fragsearch.model.embed import embed_extracted
from fragsearch.model.features import content_key
from fragsearch.model.image import RegionExtractor
from fragsearch.model.imageio import load_image
from fragsearch.model.words import WordTable
from tests import labelled
from tests.netns import REPO, hosts, in_ns, ray_env, ray_temp, stop_ray
from tests.test_index import IMAGE_CFG, WORDS, F, make_bundle, picture

CFG = shard_settings(IMAGE_CFG)
# the served model's image settings (model/variants/full.toml), as index.bulk's region flags, for the Ray runs
RAY_CFG = ImageConfig(region_features="crop", backbone_precision="int8", proposal_resize=112, backbone_size=224,
                      min_box_frac=0.25)
RAY_FLAGS = ["--region-features", "crop", "--backbone-precision", "int8", "--proposal-resize", "112",
             "--backbone-size", "224", "--min-box-frac", "0.25"]
JOB_TIMEOUT_S = 600


def photo_folder(root: Path) -> Path:
    """Five small pictures (one in a sub-folder, one grey-scale, two of one name) and one broken file."""
    photos = root / "photos"
    (photos / "sub").mkdir(parents=True)
    picture((220, 30, 30), "circle").save(photos / "red.jpg")
    picture((30, 60, 220), "square", (200, 100)).save(photos / "sub" / "blue.png")
    picture((30, 170, 60), "circle").save(photos / "sub" / "red.jpg")
    picture((200, 200, 40), "square", (96, 128)).save(photos / "yellow.jpg")
    img = Image.new("L", (150, 110), 40)
    ImageDraw.Draw(img).ellipse((30, 20, 110, 90), fill=220)
    img.save(photos / "grey.png")
    (photos / "broken.jpg").write_bytes(b"not an image")
    return photos


@pytest.fixture(scope="module")
def words() -> WordTable:
    return WordTable.build(WORDS)


@pytest.fixture(scope="module")
def ray_extractor() -> RegionExtractor:
    return RegionExtractor(RAY_CFG)


@pytest.fixture(scope="module")
def extractor() -> RegionExtractor:
    return RegionExtractor(CFG)


def plain(extractor: RegionExtractor, path: str) -> tuple[np.ndarray, np.ndarray]:
    """The plain extractor's (boxes, float16 features) of one file: what a shard must hold."""
    frags = extractor.extract(load_image(Path(path).read_bytes(), name=path))
    return frags.boxes, frags.features.astype(np.float16)


def shard_rows(folder: Path) -> dict[str, tuple[str, np.ndarray, np.ndarray, tuple[int, int]]]:
    """path → (content key, boxes, features, size) over every shard in ``folder``."""
    rows = {}
    for f in shard_files(folder):
        s = read_shard(f)
        for k, p in enumerate(s.paths):
            assert p not in rows, f"{p} is in two shards"
            rows[p] = (s.keys[k], s.boxes[k], s.features[k], (int(s.sizes[k, 0]), int(s.sizes[k, 1])))
    return rows


def check_shards_equal_plain(folder: Path, photos: Path, extractor: RegionExtractor) -> None:
    rows = shard_rows(folder)
    good = sorted(str(p.resolve()) for p in list_images(photos) if p.name != "broken.jpg")
    assert sorted(rows) == good
    for p, (key, boxes, feats, size) in rows.items():
        want_boxes, want_feats = plain(extractor, p)
        assert key == content_key(Path(p).read_bytes())
        assert size == Image.open(p).size
        assert feats.dtype == np.float16 and feats.shape == (extractor.cfg.n_fragments, 1280)
        np.testing.assert_array_equal(boxes, want_boxes)
        np.testing.assert_array_equal(feats, want_feats)
    failed = json.loads((folder / FAILED_FILE).read_text())
    assert list(failed) == ["broken.jpg"] and "broken.jpg" in failed["broken.jpg"]


def test_local_engine_writes_the_plain_extractor_features_in_shards_and_resumes(tmp_path: Path,
                                                                               extractor: RegionExtractor):
    photos = photo_folder(tmp_path)
    out = tmp_path / "shards"
    report = bulk_extract(list_images(photos), out, IMAGE_CFG, "local", workers=1, shard_size=2, progress=False)
    assert (report.extracted, report.failed, report.present) == (5, 1, 0)
    assert [f.name for f in shard_files(out)] == ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]
    check_shards_equal_plain(out, photos, extractor)
    # a second run finds everything in the shards and writes nothing
    again = bulk_extract(list_images(photos), out, IMAGE_CFG, "local", workers=1, shard_size=2, progress=False)
    assert (again.extracted, again.present) == (0, 5) and len(shard_files(out)) == 3
    # a new picture in the folder: only it is extracted, into a new shard
    picture((120, 40, 160), "circle").save(photos / "purple.jpg")
    more = bulk_extract(list_images(photos), out, IMAGE_CFG, "local", workers=1, shard_size=2, progress=False)
    assert (more.extracted, more.present) == (1, 5)
    assert [p for p in read_shard(shard_files(out)[-1]).paths] == [str((photos / "purple.jpg").resolve())]


def test_images_in_the_feature_cache_are_copied_not_extracted(tmp_path: Path, extractor: RegionExtractor):
    from fragsearch.model.cache import FeatureCache

    photos = photo_folder(tmp_path)
    cache = FeatureCache(tmp_path / "cache", CFG)
    paths = [p for p in list_images(photos) if p.name != "broken.jpg"]
    cache.ensure(paths[:2], progress=False)
    # the ray engine is never started: the two cached images are all there is to do
    report = bulk_extract(paths[:2], tmp_path / "shards", IMAGE_CFG, "ray", cache=cache, progress=False)
    assert (report.extracted, report.from_cache) == (0, 2)
    rows = shard_rows(tmp_path / "shards")
    for p in paths[:2]:
        np.testing.assert_array_equal(rows[str(p.resolve())][2], plain(extractor, str(p.resolve()))[1])


def test_a_shard_folder_keeps_one_set_of_settings(tmp_path: Path):
    with ShardWriter(tmp_path / "s", CFG) as writer:
        assert writer.written == 0
    with pytest.raises(ShardError, match="other feature settings"):
        ShardWriter(tmp_path / "s", dataclasses.replace(CFG, backbone_size=448))
    # full-frame settings share the shards of the same settings with regions (row 0 is the whole image)
    ShardWriter(tmp_path / "s", dataclasses.replace(CFG, full_frame_only=True)).close()


def test_temp_files_of_an_interrupted_write_are_not_shards(tmp_path: Path):
    out = tmp_path / "s"
    ShardWriter(out, CFG).close()
    (out / ".4242.shard-00000.npz.abc.tmp").write_bytes(b"half a shard")
    assert shard_files(out) == [] and done_paths(out) == set()


@pytest.mark.parametrize("kind", ["flat", "ivf"])  # ivf: loaded inside index.bulk(), saved once
def test_shards_load_into_an_index_through_its_add_api_and_resume(tmp_path: Path, words, kind: str):
    photos = photo_folder(tmp_path)
    out = tmp_path / "shards"
    bulk_extract(list_images(photos), out, IMAGE_CFG, "local", workers=1, shard_size=3, progress=False)
    bundle = make_bundle(words)
    index = ImageIndex.create(tmp_path / "idx", bundle, IndexSettings.of(kind=kind))
    assert load_shards(index, out, chunk=2, progress=False) == 5
    assert len(index) == 5
    # each image went in as if added by the index itself from the plain extractor's features
    blue = str((photos / "sub" / "blue.png").resolve())
    hit = index.photos.find([blue])[blue]
    rec = index.get(hit)
    assert rec is not None and (rec.width, rec.height) == (200, 100) and rec.name == "blue.png"
    direct = index.add([Image.open(blue).convert("RGB")], ["blue-direct"], [tmp_path / "direct.png"])[0]
    got = index.store.rows(int(index.items.seg[hit]), int(index.items.off[hit]), F)
    want = index.store.rows(int(index.items.seg[direct]), int(index.items.off[direct]), F)
    np.testing.assert_allclose(got, want, atol=2e-2)  # shards keep features in float16, as the cache does
    index.remove(direct)
    index.save()
    # loading again adds nothing; the saved index reopens with the five images
    assert load_shards(index, out, progress=False) == 0
    index.close()
    again = ImageIndex.load(tmp_path / "idx", bundle)
    assert len(again) == 5 and sorted(again.photos.find(list(shard_rows(out))).keys()) == sorted(shard_rows(out))
    again.close()


def test_detector_labels_reach_the_index_through_feature_and_embedded_shards(tmp_path: Path):
    """A model whose regions carry the detector's classes: the Flickr8K dog photo bulk-extracted into feature
    shards and loaded has the labels of the photo indexed directly; shards of its embedded vectors (the model
    run where the shards are made) carry the labels beside the vectors and load with them too."""
    photos = tmp_path / "photos"
    photos.mkdir()
    photo = photos / labelled.DOG
    photo.write_bytes(labelled.dog_photo_path().read_bytes())
    bundle = labelled.labelled_bundle()
    direct, direct_id = labelled.dog_index(tmp_path / "direct", bundle)
    want = direct.get(direct_id)
    assert want is not None and "dog" in want.labels
    bulk_extract([photo], tmp_path / "shards", labelled.LABELLED_CFG, "local", workers=1, progress=False)
    index = ImageIndex.create(tmp_path / "idx", bundle, IndexSettings.of(exact_below=0, k_prime=4096))
    assert load_shards(index, tmp_path / "shards", progress=False) == 1
    [image_id] = index.photos.find([str(photo.resolve())]).values()
    got = index.get(image_id)
    assert got is not None and got.labels == want.labels

    [shard] = shard_files(tmp_path / "shards")
    [embedded] = embed_extracted(bundle, [read_shard(shard).fragments(0)])
    assert embedded.labels == want.labels
    out = tmp_path / "embedded"
    with ShardWriter(out, labelled.LABELLED_CFG, embedded_by=index.fingerprint, dim=bundle.dim) as writer:
        writer.add_vectors("k", photo.name, str(photo), embedded.vectors, embedded.boxes, embedded.width,
                           embedded.height, embedded.labels)
        with pytest.raises(ValueError, match="labels for"):
            writer.add_vectors("k2", "other.jpg", "/other.jpg", embedded.vectors, embedded.boxes, 1, 1,
                               embedded.labels[:3])
    stored = read_shard(shard_files(out)[0])
    assert stored.labels is not None and stored.labels_of(0) == want.labels
    again = ImageIndex.create(tmp_path / "idx2", bundle, IndexSettings.of(exact_below=0, k_prime=4096))
    assert load_shards(again, out, progress=False) == 1
    [again_id] = again.photos.find([str(photo)]).values()
    loaded = again.get(again_id)
    assert loaded is not None and loaded.labels == want.labels
    hit = again.search(labelled.DOG_SENTENCE, 1).hits[0]
    assert all(m.label == want.labels[m.fragment] for m in hit.alignment)
    for idx in (direct, index, again):
        idx.close()


def test_loading_shards_of_other_settings_than_the_model_fails(tmp_path: Path, words):
    ShardWriter(tmp_path / "s", dataclasses.replace(CFG, backbone_size=448)).close()
    index = ImageIndex.create(tmp_path / "idx", make_bundle(words))
    with pytest.raises(ShardError, match="other image settings"):
        load_shards(index, tmp_path / "s", progress=False)
    with pytest.raises(ShardError, match="not a shard folder"):
        load_shards(index, tmp_path / "nothing", progress=False)
    index.close()


@pytest.mark.slow
def test_ray_engine_gives_the_plain_extractor_features(tmp_path: Path, ray_extractor: RegionExtractor):
    """``python -m fragsearch.index.bulk --engine ray`` (proposals on Ray CPU tasks, the backbone on a Ray actor) in a
    namespace of its own (tests/netns.py: Ray there listens on loopback only): the same boxes and
    features, bit for bit in float16, as RegionExtractor in this process; unreadable files recorded;
    a second run resumes with nothing to do."""
    photos = photo_folder(tmp_path)
    out = tmp_path / "shards"
    temp = ray_temp()
    cmd = [sys.executable, "-m", "fragsearch.index.bulk", "--engine", "ray", "--workers", "1", "--images", str(photos),
           "--shards", str(out), "--no-cache", "--batch", "2", "--shard-size", "2",
           "--model", str(tmp_path / "no-model.pt"), *RAY_FLAGS]
    try:
        with hosts(1) as (host,):
            for _ in range(2):
                job = subprocess.run(in_ns(host, *cmd), env=ray_env(temp), cwd=REPO, capture_output=True, text=True,
                                     timeout=JOB_TIMEOUT_S)
                assert job.returncode == 0, job.stderr[-4000:]
    finally:
        stop_ray([], [temp])
    check_shards_equal_plain(out, photos, ray_extractor)
    assert len(shard_files(out)) == 3
    assert ": 0 extracted" in job.stderr and "5 present" in job.stderr  # the second run found them all in the shards


def test_image_config_round_trips_through_the_manifest(tmp_path: Path):
    ShardWriter(tmp_path / "s", CFG).close()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert ImageConfig(**manifest["image"]) == CFG
