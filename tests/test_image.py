"""Image loading, region fragments and the feature cache."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import multiprocessing
import os
import signal
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from fragsearch.model.cache import ExtractionPool, FeatureCache, config_key, read_entry
from fragsearch.model.config import ImageConfig
from fragsearch.model.features import PhotoReader, content_key
from fragsearch.model.graphs import FEATURE_DIM
from fragsearch.model.image import ImageFragments, RegionExtractor, working_image
from fragsearch.model.imageio import ImageReadError, ImageTooLargeError, Photo, load_image, read_image
from fragsearch.model.onnx import set_threads
from fragsearch.model.proposals import propose_boxes
from fragsearch.model.release import read_manifest
from fragsearch.model.variants import load_variant

SQUARE = (120.0, 110.0, 200.0, 190.0)


def shapes_picture(size: int = 224) -> Image.Image:
    """A red circle and a blue square on white."""
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    draw.ellipse((20, 20, 100, 100), fill=(220, 20, 20))
    draw.rectangle(SQUARE, fill=(20, 40, 220))
    return img


def jpeg_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG claiming width x height RGB pixels, with no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")


def iou(a: np.ndarray, b: tuple[float, float, float, float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    set_threads(1)


@pytest.fixture(scope="module")
def roi_extractor() -> RegionExtractor:
    return RegionExtractor(ImageConfig(region_features="roi_align"))


# -- load_image ----------------------------------------------------------------------------------


def test_load_image_rejects_random_bytes() -> None:
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with pytest.raises(ImageReadError, match="not a recognised image"):
        load_image(noise)


def test_load_image_rejects_truncated_jpeg(tmp_path: Path) -> None:
    data = jpeg_bytes(shapes_picture())
    cut = data[: len(data) // 2]
    with pytest.raises(ImageReadError, match="truncated"):
        load_image(cut)
    path = tmp_path / "cut.jpg"
    path.write_bytes(cut)
    with pytest.raises(ImageReadError, match="cut.jpg"):
        load_image(path)


def test_load_image_rejects_oversize_header_before_decoding() -> None:
    with pytest.raises(ImageReadError, match="too large"):
        load_image(png_header(100_000, 100_000))
    with pytest.raises(ImageReadError, match="5000x4000"):
        load_image(png_header(5000, 4000), max_pixels=1_000_000)
    with pytest.raises(ImageReadError, match="too large"):
        load_image(jpeg_bytes(shapes_picture()), max_pixels=100 * 100)


def test_load_image_gives_rgb(tmp_path: Path) -> None:
    rgba = Image.new("RGBA", (30, 20), (255, 0, 0, 0))
    path = tmp_path / "a.png"
    rgba.save(path)
    img = load_image(path)
    assert img.mode == "RGB" and img.size == (30, 20)
    assert img.getpixel((0, 0)) == (255, 255, 255)  # transparent → white
    assert load_image(jpeg_bytes(shapes_picture())).size == (224, 224)


def test_load_image_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ImageReadError, match="cannot open"):
        load_image(tmp_path / "nope.jpg")


# -- fragments -----------------------------------------------------------------------------------


def check_fragments(fr: object, n: int, width: int, height: int) -> None:
    boxes, feats = fr.boxes, fr.features  # type: ignore[attr-defined]
    assert boxes.shape == (n, 4) and boxes.dtype == np.float32
    assert feats.shape == (n, FEATURE_DIM) and feats.dtype == np.float32
    assert np.isfinite(feats).all()
    np.testing.assert_allclose(boxes[0], [0, 0, width, height])
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
    assert (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
    assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()


def test_roi_align_fragments(roi_extractor: RegionExtractor) -> None:
    fr = roi_extractor.extract(shapes_picture())
    check_fragments(fr, 20, 224, 224)
    assert (fr.width, fr.height) == (224, 224)
    assert max(iou(b, SQUARE) for b in fr.boxes[1:]) > 0.5
    again = roi_extractor.extract(shapes_picture())
    np.testing.assert_array_equal(fr.boxes, again.boxes)  # proposals are deterministic


def test_crop_fragments() -> None:
    fr = RegionExtractor(ImageConfig(region_features="crop")).extract(shapes_picture())
    check_fragments(fr, 20, 224, 224)
    assert max(iou(b, SQUARE) for b in fr.boxes[1:]) > 0.5


def test_the_mirrored_view_is_the_mirrored_images_crops_of_the_same_boxes() -> None:
    """ImageConfig.mirror (a training view): the boxes of the image as it is, each crop's features
    those of the mirrored image's mirrored box; only crop features can be mirrored."""
    from fragsearch.model.image import region_crops

    cfg = ImageConfig(region_features="crop")
    img = shapes_picture().resize((260, 200))
    plain = RegionExtractor(cfg).extract(img)
    mirrored = RegionExtractor(dataclasses.replace(cfg, mirror=True)).extract(img)
    np.testing.assert_array_equal(mirrored.boxes, plain.boxes)
    boxes = plain.boxes.copy()
    boxes[:, [0, 2]] = img.size[0] - plain.boxes[:, [2, 0]]
    flipped = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    expected = RegionExtractor(cfg).backbone.pooled(region_crops(flipped, boxes, cfg.crop_size))
    cosine = (mirrored.features * expected).sum(1) / (
        np.linalg.norm(mirrored.features, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() > 0.99, cosine.min()
    assert not np.allclose(mirrored.features, plain.features, atol=1e-2)  # the shapes are not symmetric
    with pytest.raises(ValueError, match="mirror"):
        RegionExtractor(ImageConfig(mirror=True))


def test_non_square_image_and_batch(roi_extractor: RegionExtractor) -> None:
    wide = shapes_picture().resize((300, 150))
    frs = roi_extractor.extract_batch([wide, shapes_picture()])
    check_fragments(frs[0], 20, 300, 150)
    check_fragments(frs[1], 20, 224, 224)


def test_blank_image_is_filled_from_grid(roi_extractor: RegionExtractor) -> None:
    fr = roi_extractor.extract(Image.new("RGB", (64, 64), "white"))
    check_fragments(fr, 20, 64, 64)


@pytest.mark.parametrize("method", ["roi_align", "crop"])
def test_full_frame_only(method: str) -> None:
    cfg = ImageConfig(region_features=method, full_frame_only=True)
    fr = RegionExtractor(cfg).extract(shapes_picture())
    check_fragments(fr, 1, 224, 224)


def test_proposals_find_the_square() -> None:
    boxes = propose_boxes(np.asarray(shapes_picture()), ImageConfig())
    assert boxes.shape[1] == 4 and len(boxes) <= ImageConfig().max_proposals
    assert max(iou(b, SQUARE) for b in boxes) > 0.7


# -- the reading side (ImageConfig.decode_side) ---------------------------------------------------------


def big_picture(width: int, height: int) -> Image.Image:
    """The shapes picture stretched to width x height (a camera-sized picture of the same scene)."""
    return shapes_picture().resize((width, height), Image.Resampling.BILINEAR)


def exif_rotated_jpeg(img: Image.Image) -> bytes:
    """A JPEG of `img` stored sideways, with the EXIF orientation (6: turn 90 degrees clockwise) that
    puts it upright."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.transpose(Image.Transpose.ROTATE_90).save(buf, format="JPEG", quality=90, exif=exif)
    return buf.getvalue()


def test_a_large_jpeg_is_decoded_at_a_reduced_size_no_smaller_than_the_side() -> None:
    data = jpeg_bytes(big_picture(1600, 1200))
    photo = read_image(data, side=300)
    assert (photo.width, photo.height) == (1600, 1200)
    assert photo.image.size == (400, 300)  # 1/4: the smallest decode whose longer side is still >= 300
    assert read_image(data, side=500).image.size == (800, 600)  # 1/4 would be 400 < 500
    assert read_image(data).image.size == (1600, 1200) == read_image(data, side=1600).image.size
    png = io.BytesIO()
    big_picture(1600, 1200).save(png, format="PNG")
    assert read_image(png.getvalue(), side=300).image.size == (1600, 1200)  # no reduced decode: the reader reduces
    mpo = io.BytesIO()  # a phone's JPEG: a multi-picture file (the photo and a smaller one)
    big_picture(1600, 1200).save(mpo, format="MPO", save_all=True, append_images=[shapes_picture()])
    assert Image.open(io.BytesIO(mpo.getvalue())).format == "MPO"
    assert read_image(mpo.getvalue(), side=300).image.size == (400, 300)


def test_a_sideways_jpeg_read_at_a_reduced_size_keeps_its_upright_size() -> None:
    photo = read_image(exif_rotated_jpeg(big_picture(1600, 1200)), side=300)
    assert (photo.width, photo.height) == (1600, 1200)
    assert photo.image.size == (400, 300)
    assert load_image(exif_rotated_jpeg(big_picture(1600, 1200))).size == (1600, 1200)


def test_a_picture_larger_than_the_side_is_read_at_it_with_boxes_in_its_own_pixels() -> None:
    cfg = ImageConfig(region_features="crop", decode_side=448)
    big = big_picture(1792, 896)
    work = working_image(big, cfg)
    assert work.size == (448, 224)
    extractor = RegionExtractor(cfg)
    frag = extractor.extract(big)
    at_side = extractor.extract(work)
    check_fragments(frag, cfg.n_fragments, 1792, 896)
    np.testing.assert_array_equal(frag.features, at_side.features)  # what is read is the picture at the side
    np.testing.assert_allclose(frag.boxes, at_side.boxes * 4, rtol=1e-6)  # given back in the picture's pixels
    assert frag.boxes[0].tolist() == [0, 0, 1792, 896]
    own = RegionExtractor(dataclasses.replace(cfg, decode_side=0)).extract(big)
    assert not np.array_equal(own.features, frag.features)  # side 0: read at its own size
    small = big_picture(400, 200)
    np.testing.assert_array_equal(extractor.extract(small).features,
                                  RegionExtractor(dataclasses.replace(cfg, decode_side=0)).extract(small).features)


def test_a_photo_read_at_a_reduced_size_gives_boxes_in_the_photos_pixels() -> None:
    cfg = ImageConfig(region_features="crop", decode_side=448)
    photo = read_image(jpeg_bytes(big_picture(1792, 1344)), side=cfg.decode_side)
    assert photo.image.size == (448, 336)
    frag = RegionExtractor(cfg).extract(photo)
    assert isinstance(frag, ImageFragments)
    check_fragments(frag, cfg.n_fragments, 1792, 1344)
    assert frag.boxes[0].tolist() == [0, 0, 1792, 1344]
    assert frag.boxes[:, 2].max() > 448  # in the photo's pixels, not the decoded image's
    at_decoded = RegionExtractor(cfg).extract(Photo(photo.image, *photo.image.size))
    np.testing.assert_allclose(frag.boxes, at_decoded.boxes * 4, rtol=1e-6)


def test_an_entry_of_a_picture_larger_than_the_side_is_keyed_by_the_side_too() -> None:
    large, small = jpeg_bytes(big_picture(1600, 1200)), jpeg_bytes(shapes_picture())
    assert content_key(small, 1024) == content_key(small) == content_key(small, 224) != content_key(small, 100)
    assert content_key(large, 1024) != content_key(large) == content_key(large, 0) == content_key(large, 1600)
    assert content_key(large, 1024) != content_key(large, 512)
    assert content_key(b"not an image", 1024) == content_key(b"not an image")
    assert config_key(ImageConfig(decode_side=512)) == config_key(ImageConfig())  # the folder's key stays


def test_the_photo_reader_keys_and_reads_at_the_models_side() -> None:
    cfg = ImageConfig(decode_side=448)
    large = jpeg_bytes(big_picture(1792, 1344))
    reader = PhotoReader.of(cfg, max_pixels=4_000_000)
    assert reader.key(large) == content_key(large, 448) != content_key(large)
    assert reader.read(large).image.size == (448, 336)
    assert (reader.read(large).width, reader.read(large).height) == (1792, 1344)
    assert reader.read(large, full=True).image.size == (1792, 1344)
    with pytest.raises(ImageTooLargeError):
        PhotoReader.of(cfg, max_pixels=1_000_000).read(large)


# -- cache ---------------------------------------------------------------------------------------


@pytest.fixture()
def picture_files(tmp_path: Path) -> list[Path]:
    src = tmp_path / "src"
    src.mkdir()
    paths = []
    for k, img in enumerate([shapes_picture(), shapes_picture().transpose(Image.Transpose.FLIP_LEFT_RIGHT)]):
        p = src / f"pic{k}.png"
        img.save(p)
        paths.append(p)
    bad = src / "notes.jpg"
    bad.write_text("not an image")
    paths.append(bad)
    return paths


def test_cache_ensure_reuse_and_failures(tmp_path: Path, picture_files: list[Path]) -> None:
    cfg = ImageConfig()
    cache = FeatureCache(tmp_path / "cache", cfg)
    first = cache.ensure(picture_files, progress=False)
    assert (first.extracted, first.reused) == (2, 0)
    assert [n for n, _ in first.failed] == ["notes.jpg"]
    assert cache.dir.name == config_key(cfg)
    assert cache.has(picture_files[0]) and cache.has(picture_files[1]) and not cache.has(picture_files[2])
    assert cache.path(picture_files[0]) == cache.dir / f"{content_key(picture_files[0].read_bytes())}.npz"
    assert cache.path(picture_files[0]).is_file()
    assert "notes.jpg" in cache.failed()

    second = cache.ensure(picture_files, progress=False)
    assert (second.extracted, second.reused, len(second.failed)) == (0, 2, 1)

    frs = cache.load(picture_files[:2])
    feats, boxes = cache.load_arrays(picture_files[:2])
    assert feats.shape == (2, 20, FEATURE_DIM) and feats.dtype == np.float32
    assert boxes.shape == (2, 20, 4)
    np.testing.assert_array_equal(feats[0], frs[0].features)
    np.testing.assert_array_equal(boxes[1], frs[1].boxes)
    direct = RegionExtractor(cfg).extract(load_image(picture_files[0]))
    np.testing.assert_allclose(frs[0].features, direct.features, rtol=2e-3, atol=2e-3)
    with pytest.raises(KeyError):
        cache.load([picture_files[2]])


def test_cache_is_keyed_by_content_not_name(tmp_path: Path) -> None:
    """Two different photos with the same name and size get their own features; a renamed copy of a
    cached photo is not extracted again."""
    cfg = ImageConfig(full_frame_only=True)
    cache = FeatureCache(tmp_path / "cache", cfg)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "same.bmp", tmp_path / "b" / "same.bmp"  # BMP: size set by the dimensions
    shapes_picture().save(first)
    Image.new("RGB", (224, 224), (10, 200, 30)).save(second)
    assert first.stat().st_size == second.stat().st_size
    report = cache.ensure([first, second], progress=False)
    assert (report.extracted, report.reused) == (2, 0)
    feats, _ = cache.load_arrays([first, second])
    assert not np.allclose(feats[0], feats[1])
    renamed = tmp_path / "renamed.bmp"
    renamed.write_bytes(first.read_bytes())
    again = cache.ensure([renamed], progress=False)
    assert (again.extracted, again.reused) == (0, 1)
    np.testing.assert_array_equal(cache.load_arrays([renamed])[0], feats[:1])


def test_cache_interrupted_write_is_not_cached(tmp_path: Path, picture_files: list[Path]) -> None:
    cfg = dataclasses.replace(ImageConfig(), full_frame_only=True)
    cache = FeatureCache(tmp_path / "cache", cfg)
    cache.dir.mkdir(parents=True)
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    leftover = cache.dir / f".{dead_pid}.{cache.path(picture_files[0]).name}.abc123.tmp"
    leftover.write_bytes(b"PK\x03\x04 half-written")
    assert not cache.has(picture_files[0])
    report = cache.ensure(picture_files[:1], progress=False)
    assert (report.extracted, report.reused) == (1, 0)
    assert cache.has(picture_files[0]) and not leftover.exists()
    assert not [p for p in os.listdir(cache.dir) if p.endswith(".tmp")]
    assert cache.load(picture_files[:1])[0].features.shape == (1, FEATURE_DIM)


def test_the_extraction_pool_prepare_uses_agrees_with_in_process_extraction(tmp_path: Path,
                                                                           picture_files: list[Path]) -> None:
    """The pool of worker processes `python -m fragsearch.service` prepares with (two, as it starts on a 2-core
    machine; the served variant's image settings) extracts what this process extracts, and reports an
    unreadable file."""
    workers = 2
    cfg = load_variant(read_manifest()["name"]).image  # the released model's image settings
    small = []
    for k, angle in enumerate((0, 90, 180)):  # a handful of small pictures
        small.append(tmp_path / f"small{k}.png")
        shapes_picture().rotate(angle).resize((96, 96)).save(small[-1])
    paths = [*small, picture_files[2]]  # and the file that is not an image
    (tmp_path / "pool").mkdir()
    before = {p.pid for p in multiprocessing.active_children()}
    with ExtractionPool(cfg, workers=workers) as pool:
        done, failed = pool.run(paths, batch=1, out_dir=tmp_path / "pool", progress=False)  # one task per file
        started = {p.pid for p in multiprocessing.active_children()} - before
        assert len(started) == workers, "the pool extracts in its own worker processes"
    assert done == len(small) and [name for name, _ in failed] == ["notes.jpg"]
    here = RegionExtractor(cfg)
    for path in small:
        pooled = read_entry(tmp_path / "pool" / f"{content_key(path.read_bytes())}.npz")
        direct = here.extract(load_image(path))
        np.testing.assert_allclose(pooled.boxes, direct.boxes, atol=1e-3)
        np.testing.assert_allclose(pooled.features, direct.features, rtol=2e-3, atol=2e-3)  # stored as float16


@pytest.mark.slow  # a pool of worker processes started, one killed, the run waited out
def test_a_killed_pool_worker_fails_the_run_instead_of_hanging(tmp_path: Path) -> None:
    """A pool worker killed during a run (SIGKILL, as the out-of-memory killer does): the run raises with
    the worker's exit code instead of waiting for ever for the task it took, and the pool still closes.
    The tasks are named pipes no one writes, so that no task can finish before the kill."""
    cfg = load_variant(read_manifest()["name"]).image  # the released model's image settings
    pipes = [tmp_path / f"pipe{k}.jpg" for k in range(2)]
    for pipe in pipes:
        os.mkfifo(pipe)
    outcome: list[object] = []
    with ExtractionPool(cfg, workers=2) as pool:
        pool.warm_up([])  # both workers started and ready
        victim, survivor = pool._procs

        def run() -> None:
            try:
                outcome.append(pool.run(pipes, batch=1, progress=False))  # one task per pipe
            except RuntimeError as e:
                outcome.append(e)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        os.kill(victim.pid, signal.SIGKILL)
        runner.join(timeout=60)
        assert not runner.is_alive(), "the run waits for a dead worker"
        for pipe in pipes:  # let the survivor finish the task it blocks on (an empty file), so it can stop
            with contextlib.suppress(OSError):
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert str(outcome[0]) == f"an extraction worker exited with code {-signal.SIGKILL}"
    assert not victim.is_alive() and not survivor.is_alive()
