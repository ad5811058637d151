"""`./run data` (model/flickr8k.py) on tiny Flickr8K look-alikes built here from generated JPEGs: the
official download's layout and the CSV mirror's become the project's layout, which the project's own
readers load; the source is never written; the check reports what is wrong with a folder."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest
from PIL import Image

from fragsearch.commands.data import main
from fragsearch.model.data import DataError, load_split
from fragsearch.model.flickr8k import check, convert, layout_of

TRAIN, DEV, TEST = ["a_1.jpg", "b_2.jpg", "c_3.jpg"], ["d_4.jpg", "e_5.jpg"], ["f_6.jpg"]
ALL = TRAIN + DEV + TEST


def _jpeg(path: Path, k: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 24), (40 * k % 256, 90, 160)).save(path, "JPEG")


def _captions(name: str) -> list[str]:
    return [f"a dog number {name[0]} runs , caption {k} ." for k in range(5)]


def _official(root: Path) -> Path:
    """Flicker8k_Dataset/ (the download's spelling) and Flickr8k_text/ with the token file and split lists."""
    for k, name in enumerate(ALL):
        _jpeg(root / "Flicker8k_Dataset" / name, k)
    text = root / "Flickr8k_text"
    text.mkdir(parents=True)
    lines = [f"{n}#{k}\t{c}" for n in ALL for k, c in enumerate(_captions(n))]
    lines.append("2258277193_586949ec62.jpg.1#0\tA name the download has captions for and no image .")
    (text / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    for split, names in (("train", TRAIN), ("dev", DEV), ("test", TEST)):
        (text / f"Flickr_8k.{split}Images.txt").write_text("\n".join(names) + "\n")
    return root


def _csv_mirror(root: Path) -> Path:
    for k, name in enumerate(ALL):
        _jpeg(root / "Images" / name, k)
    rows = ["image,caption"] + [f'{n},"{c}"' if "," in c else f"{n},{c}" for n in ALL for c in _captions(n)]
    (root / "captions.txt").write_text("\n".join(rows) + "\n")
    return root


def _tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_official_download_becomes_the_project_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _official(tmp_path / "download")
    before = _tree_digest(src)
    with caplog.at_level(logging.INFO, logger="fragsearch.model.flickr8k"):
        dest = convert(src, tmp_path / "flickr8k")
    assert "6 images: 6 hard-linked, 0 copied, 0 there already" in caplog.text
    assert _tree_digest(src) == before  # the source is only read
    assert sorted(p.name for p in (dest / "images").iterdir()) == sorted(ALL)
    assert (dest / "images" / "a_1.jpg").stat().st_ino == (src / "Flicker8k_Dataset" / "a_1.jpg").stat().st_ino
    assert (dest / "train.txt").read_text().split() == TRAIN and (dest / "test.txt").read_text().split() == TEST
    train = load_split(dest, "train")  # what training and the service read
    assert train.images == tuple(TRAIN) and train.captions[0] == tuple(_captions("a_1.jpg"))
    assert load_split(dest, "dev").images == tuple(DEV)
    assert "2258277193_586949ec62.jpg.1" not in (dest / "captions.txt").read_text()  # its image is not there
    report = check(dest)
    assert report.ok, report.errors
    assert (report.images, report.captions, dict(report.per_image)) == (6, 30, {5: 6})
    assert report.splits == {"train": 3, "dev": 2, "test": 1} and report.warnings == []
    (dest / "images" / "b_2.jpg").unlink()  # an interrupted run: a second one completes it
    with caplog.at_level(logging.INFO, logger="fragsearch.model.flickr8k"):
        convert(src, dest)
    assert "6 images: 1 hard-linked, 0 copied, 5 there already" in caplog.text


def test_the_csv_mirror_needs_the_official_split_lists(tmp_path: Path) -> None:
    src = _csv_mirror(tmp_path / "mirror")
    assert layout_of(src) == "csv"
    with pytest.raises(DataError, match="--splits DIR.*Flickr_8k.trainImages.txt"):
        convert(src, tmp_path / "out")
    lists = _official(tmp_path / "official") / "Flickr8k_text"
    dest = convert(src, tmp_path / "out", splits_dir=lists, copy=True)
    assert (dest / "images" / "a_1.jpg").stat().st_ino != (src / "Images" / "a_1.jpg").stat().st_ino  # copied
    assert (dest / "images" / "a_1.jpg").read_bytes() == (src / "Images" / "a_1.jpg").read_bytes()
    dev = load_split(dest, "dev")
    assert dev.images == tuple(DEV) and dev.captions[1] == tuple(_captions("e_5.jpg"))  # commas kept, order kept
    assert check(dest).ok


def test_a_project_layout_folder_is_checked_in_place(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dest = convert(_official(tmp_path / "download"), tmp_path / "flickr8k")
    before = _tree_digest(dest)
    with caplog.at_level(logging.INFO, logger="fragsearch.model.flickr8k"):
        assert main([str(dest)]) == 0
    assert _tree_digest(dest) == before
    assert "6 images, 30 captions (images with 5 captions: 6), splits: train 3, dev 2, test 1" in caplog.text
    assert f"is usable: FRAGSEARCH_DATA={dest.resolve()}" in caplog.text


def test_the_check_names_what_is_wrong(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dest = convert(_official(tmp_path / "download"), tmp_path / "flickr8k", copy=True)
    (dest / "images" / "e_5.jpg").write_bytes((dest / "images" / "e_5.jpg").read_bytes()[:200])  # truncated
    (dest / "images" / "c_3.jpg").unlink()  # listed in train.txt, gone
    (dest / "dev.txt").write_text("d_4.jpg\ne_5.jpg\nb_2.jpg\n")  # b_2 is a training image too
    lines = (dest / "captions.txt").read_text().splitlines()
    (dest / "captions.txt").write_text("\n".join(ln for ln in lines if not ln.startswith("a_1.jpg#4")) + "\n")
    os.chmod(dest / "images" / "d_4.jpg", 0o600)
    with caplog.at_level(logging.INFO, logger="fragsearch.model.flickr8k"):
        assert main([str(dest)]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("train.txt: 1 images are not in images/: c_3.jpg" in e for e in errors), errors
    assert any("in both train.txt and dev.txt: b_2.jpg" in e for e in errors), errors
    assert any("do not decode" in e and "e_5.jpg" in e for e in errors), errors
    assert any("other than 5 captions: a_1.jpg" in w for w in warnings), warnings
    assert any("not readable by other users" in w and "UID 10001" in w and "d_4.jpg" in w for w in warnings)
    assert any("captions of 1 images not in images/: c_3.jpg" in w for w in warnings), warnings


@pytest.mark.parametrize(("source", "args", "message"), [
    ("empty", ["{src}"], "not a Flickr8K folder in a layout this knows"),
    ("absent", ["{src}"], "is not a folder"),
    ("official", ["{src}"], "the official layout: give DEST"),
    ("official", ["{src}", "{src}/out"], "must lie outside SRC"),
])
def test_bad_input_is_one_clear_error(source: str, args: list[str], message: str, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "src"
    if source == "empty":
        src.mkdir()
    elif source == "official":
        _official(src)
    with caplog.at_level(logging.INFO, logger="fragsearch.model.flickr8k"):
        assert main([a.format(src=src) for a in args]) == 2
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert message in error
