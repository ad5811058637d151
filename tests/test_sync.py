"""Syncing an index with a folder of photos: add, change, touch, rename, delete, unreadable and
unsupported files, re-runs that change nothing, and an interrupted run's images adopted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fragsearch.commands.index_sync import main
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.sync import (
    IGNORE_FILE,
    MANIFEST,
    ignore_patterns,
    ignored,
    read_manifest,
    sync_folder,
    walk,
)
from tests.conftest import exported
from tests.synthetic import make_picture

if TYPE_CHECKING:
    from tests.conftest import ShapesModel


def picture(path: Path, seed: int) -> None:
    import random

    path.parent.mkdir(parents=True, exist_ok=True)
    make_picture(random.Random(seed))[0].save(path, "JPEG", quality=90)


def paths_of(index: ImageIndex) -> dict[str, int]:
    """stored (relative) path -> id of every live image."""
    out = {}
    for i in index.ids():
        rec = index.get(int(i))
        assert rec is not None
        out[index.photos.stored_path(rec.path)] = int(i)
    return out


def test_sync_follows_the_folder(shapes_model: ShapesModel, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    for n, rel in enumerate(["a.jpg", "b.jpg", "trip/c.jpg", "trip/same.jpg", "home/same.jpg"]):
        picture(photos / rel, n)
    (photos / ".hidden.jpg").write_bytes((photos / "a.jpg").read_bytes())
    (photos / "notes.txt").write_text("not an image")
    cache = exported(shapes_model.cache / "sync-features", shapes_model.bundle.image_cfg)
    from fragsearch.model.dataset import feature_cache

    index = ImageIndex.create(tmp_path / "index", shapes_model.bundle, IndexSettings(),
                              cache=feature_cache(cache, shapes_model.bundle.image_cfg), collection_root=photos)
    first = sync_folder(index, photos)
    assert sorted(first.added) == ["a.jpg", "b.jpg", "home/same.jpg", "trip/c.jpg", "trip/same.jpg"]
    assert sorted(paths_of(index)) == sorted(first.added), "stored relative to the folder, hidden files left out"
    ids = paths_of(index)

    again = sync_folder(index, photos)
    assert (again.added, again.changed, again.removed, again.renamed, again.unchanged) == ([], [], [], [], 5)

    picture(photos / "new/d.jpg", 10)                     # added
    picture(photos / "b.jpg", 11)                         # changed content
    stamp = (photos / "a.jpg").stat().st_mtime_ns + 5_000_000_000
    os.utime(photos / "a.jpg", ns=(stamp, stamp))         # touched only
    (photos / "moved").mkdir()
    shutil.move(photos / "trip/c.jpg", photos / "moved/c2.jpg")  # renamed
    (photos / "trip/same.jpg").unlink()                   # deleted
    (photos / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (photos / "phone.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")  # a HEIC header, no picture
    (photos / "camera.cr2").write_bytes(b"II*\x00\x10\x00\x00\x00CR")  # camera RAW: not decoded
    third = sync_folder(index, photos)
    assert third.added == ["new/d.jpg"] and third.changed == ["b.jpg"]
    assert third.renamed == [("trip/c.jpg", "moved/c2.jpg")] and third.removed == ["trip/same.jpg"]
    assert sorted(rel for rel, _ in third.unreadable) == ["broken.jpg", "phone.heic"]
    assert third.unsupported == ["camera.cr2"]
    now = paths_of(index)
    assert sorted(now) == ["a.jpg", "b.jpg", "home/same.jpg", "moved/c2.jpg", "new/d.jpg"]
    assert now["a.jpg"] == ids["a.jpg"] and now["home/same.jpg"] == ids["home/same.jpg"], "untouched keep their id"
    assert now["b.jpg"] != ids["b.jpg"], "a changed file is extracted again"
    assert set(read_manifest(index.root)) == set(now)

    # an interrupted run committed images but not the manifest: the next run adopts them, adds nothing
    (index.root / MANIFEST).unlink()
    adopted = sync_folder(index, photos)
    assert adopted.added == [] and adopted.unchanged == 5 and paths_of(index) == now
    index.close()


def test_the_command_indexes_a_folder(shapes_model: ShapesModel, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    for n in range(3):
        picture(photos / f"p{n}.jpg", 20 + n)
    out = tmp_path / "index"
    args = [str(photos), "--image-index", str(out), "--model-path", str(shapes_model.model_path),
            "--cache", str(exported(shapes_model.cache / "sync-features", shapes_model.bundle.image_cfg)),
            "--workers", "1"]
    assert main(args) == 0
    assert main(args) == 0  # a second run finds everything in place
    index = ImageIndex.load(out, shapes_model.bundle, collection_root=photos)
    assert len(index) == 3 and index.search("a red circle", 1).hits
    index.close()
    missing = [str(tmp_path / "missing"), "--image-index", str(out), "--model-path", str(shapes_model.model_path)]
    assert main(missing) == 2


def test_commits_grow_with_the_index(shapes_model: ShapesModel, tmp_path: Path) -> None:
    from fragsearch.index.shards import COMMIT_IMAGES, commit_interval
    from fragsearch.model.dataset import feature_cache

    assert [commit_interval(n, 500) for n in (0, 2_000, 4_000, 100_000, 10**6)] == [500, 500, 1_000, 25_000,
                                                                                    COMMIT_IMAGES]
    photos = tmp_path / "photos"
    for n in range(12):
        picture(photos / f"p{n:02d}.jpg", 100 + n)
    cfg = shapes_model.bundle.image_cfg
    index = ImageIndex.create(tmp_path / "index", shapes_model.bundle, IndexSettings(),
                              cache=feature_cache(exported(shapes_model.cache / "sync-features", cfg), cfg),
                              collection_root=photos)
    created = index.generation
    report = sync_folder(index, photos, save_every=1)
    assert len(report.added) == 12 and len(index) == 12
    # one image a commit up to 8 held, then a quarter of the size: 8 commits of 1, then 2 of 2
    assert index.generation - created == 10
    assert len(read_manifest(index.root)) == 12
    index.close()


@pytest.mark.parametrize(("rel", "is_dir", "left_out"), [
    ("a/b.png", False, True),            # a name pattern at any depth
    ("Screenshots", True, True),         # a folder pattern
    ("x/Screenshots", True, True),
    ("Screenshots", False, False),       # ... folders only
    ("2019/x/raw", True, True),          # a path pattern from the folder
    ("2019/x/y/raw", True, False),       # * stays within one name
    ("top.jpg", False, True),            # a leading slash anchors
    ("a/top.jpg", False, False),
    ("q/r/tmp/z.jpg", False, True),      # ** any number of folders
    ("tmp/z.jpg", False, True),
    ("bc.jpg", False, True),             # a character class
    ("dc.jpg", False, False),
    ("holiday.jpg", False, False),
])
def test_ignore_patterns_read_like_gitignore(rel: str, is_dir: bool, left_out: bool) -> None:
    patterns = ["*.png", "Screenshots/", "2019/*/raw", "/top.jpg", "**/tmp/*.jpg", "[ab]c.jpg"]
    assert ignored(rel, is_dir, patterns) is left_out


def test_the_walk_leaves_out_system_folders_and_ignored_paths(tmp_path: Path) -> None:
    for rel in ("keep.jpg", "trip/keep.jpg", "@eaDir/keep.jpg/SYNOPHOTO_THUMB_M.jpg", "#recycle/old.jpg",
                ".Trash-1000/files/gone.jpg", ".thumbnails/normal/x.png", "Screenshots/s.png", "raw/IMG_1.CR2",
                "trip/shot.png", ".hidden.jpg"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / IGNORE_FILE).write_text("# not photos\nScreenshots/\n\n")
    found, unsupported = walk(tmp_path, exclude=["trip/*.png"])
    assert sorted(found) == ["keep.jpg", "trip/keep.jpg"]
    assert unsupported == ["raw/IMG_1.CR2"]
    assert ignore_patterns(tmp_path, [" *.gif "]) == ["*.gif", "Screenshots/"]
