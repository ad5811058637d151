"""Getting Flickr8K into the project's layout, and checking a data folder.

    ./run data SRC [DEST] [--splits DIR] [--copy]        (python -m fragsearch.model.flickr8k)

SRC is one of three layouts:

* **the official download** (Flickr8k_Dataset.zip and Flickr8k_text.zip, unpacked): the JPEGs in
  `Flicker8k_Dataset/` (the download's own spelling; `Flickr8k_Dataset/` is accepted too), and
  `Flickr8k.token.txt` (`<name>.jpg#<n>\\t<caption>`) with the split lists `Flickr_8k.trainImages.txt`,
  `Flickr_8k.devImages.txt`, `Flickr_8k.testImages.txt`, in `Flickr8k_text/` or beside the images folder;
* **the CSV mirror** (a common re-upload): `Images/` and `captions.txt`, a CSV with the header
  `image,caption`. It has no split lists: pass the official ones with `--splits DIR` (the folder holding
  `Flickr_8k.trainImages.txt` and `Flickr_8k.devImages.txt`, from Flickr8k_text.zip); they are not guessed;
* **the project's layout**: `images/`, `captions.txt` (`<name>#<n>\\t<caption>`), `train.txt`, `dev.txt`
  (`test.txt` optional). Given alone, such a folder is only checked.

From the first two, DEST receives the project's layout: `images/` with a hard link to each source image
(the same file, no extra space; a copy where the file system refuses links, or with `--copy`),
`captions.txt`, `train.txt`, `dev.txt` and `test.txt`. The source is only read. Running it again
completes an interrupted conversion.

The check (run on DEST after a conversion, or on a project-layout SRC): the counts (images, captions,
captions per image, each split), split images missing from `images/` or without captions, images in two
splits, files that do not decode, captions of images that are not there, and files other users cannot
read (the Docker image runs as UID 10001). What makes the folder unusable is logged as an error and the
exit status is 1; the rest is logged as a warning.

Its command line: fragsearch/commands/data.py (`python -m fragsearch.model.flickr8k` calls it).
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import stat
import sys
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from fragsearch.model.atomic import atomic_file
from fragsearch.model.data import DataError, check_data_dir, read_captions, read_split_list
from fragsearch.model.imageio import ImageReadError, load_image
from fragsearch.model.resources import usable_cpus

logger = logging.getLogger("fragsearch.model.flickr8k")

SPLITS = ("train", "dev", "test")
REQUIRED_SPLITS = ("train", "dev")
OFFICIAL_IMAGES = ("Flicker8k_Dataset", "Flickr8k_Dataset")  # the download's spelling first
OFFICIAL_TEXT = "Flickr8k_text"
OFFICIAL_TOKENS = "Flickr8k.token.txt"
OFFICIAL_LISTS = {"train": "Flickr_8k.trainImages.txt", "dev": "Flickr_8k.devImages.txt",
                  "test": "Flickr_8k.testImages.txt"}
CSV_IMAGES, CSV_CAPTIONS, CSV_HEADER = "Images", "captions.txt", ["image", "caption"]
SHOWN = 5  # names quoted per finding


@dataclass
class Source:
    """A Flickr8K download as read: where its images are, their captions, its split lists."""

    layout: str  # "official" or "csv"
    images: Path
    captions: dict[str, list[str]]
    splits: dict[str, list[str]]


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _is_csv_captions(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return [h.strip().lower() for h in header] == CSV_HEADER


def layout_of(src: Path) -> str:
    """'project', 'official' or 'csv'; DataError naming what each layout has when SRC is none of them."""
    if not src.is_dir():
        raise DataError(f"{src} is not a folder")
    if (src / "images").is_dir() and (src / "captions.txt").is_file() and not _is_csv_captions(src / "captions.txt"):
        return "project"
    if any((src / name).is_dir() for name in OFFICIAL_IMAGES):
        return "official"
    if (src / CSV_IMAGES).is_dir() and _is_csv_captions(src / CSV_CAPTIONS):
        return "csv"
    raise DataError(
        f"{src} is not a Flickr8K folder in a layout this knows: the official download "
        f"({OFFICIAL_IMAGES[0]}/ and {OFFICIAL_TEXT}/{OFFICIAL_TOKENS}), the CSV mirror ({CSV_IMAGES}/ and "
        f"{CSV_CAPTIONS} with the header 'image,caption'), or the project's (images/, captions.txt, train.txt, "
        f"dev.txt)")


def _split_lists(folder: Path, what: str) -> dict[str, list[str]]:
    """The official split lists in `folder` (train and dev required, test when present)."""
    missing = [OFFICIAL_LISTS[s] for s in REQUIRED_SPLITS if not (folder / OFFICIAL_LISTS[s]).is_file()]
    if missing:
        raise DataError(f"{what}: no {' or '.join(missing)} in {folder} (the official split lists, in "
                        f"Flickr8k_text.zip)")
    return {s: read_split_list(folder / OFFICIAL_LISTS[s]) for s in SPLITS if (folder / OFFICIAL_LISTS[s]).is_file()}


def read_official(src: Path, splits_dir: Path | None = None) -> Source:
    """The official download: images, Flickr8k.token.txt and the split lists (from splits_dir if given)."""
    images = next(src / n for n in OFFICIAL_IMAGES if (src / n).is_dir())
    text = next((d for d in (src / OFFICIAL_TEXT, src) if (d / OFFICIAL_TOKENS).is_file()), None)
    if text is None:
        raise DataError(f"{src}: no {OFFICIAL_TOKENS} in {src / OFFICIAL_TEXT} or {src} (unpack Flickr8k_text.zip "
                        f"there)")
    return Source("official", images, read_captions(text / OFFICIAL_TOKENS),
                  _split_lists(splits_dir or text, f"{src} (official layout)"))


def read_csv_mirror(src: Path, splits_dir: Path | None) -> Source:
    """The CSV mirror: Images/ and captions.txt (image,caption); split lists only from splits_dir."""
    if splits_dir is None:
        raise DataError(f"{src} is the CSV mirror ({CSV_IMAGES}/, {CSV_CAPTIONS} with 'image,caption'), which has "
                        f"no split lists: pass --splits DIR, the folder holding the official "
                        f"{OFFICIAL_LISTS['train']} and {OFFICIAL_LISTS['dev']} (in Flickr8k_text.zip)")
    captions: dict[str, list[str]] = {}
    with open(src / CSV_CAPTIONS, encoding="utf-8", newline="") as f:
        rows = csv.reader(f)
        next(rows)
        for lineno, row in enumerate(rows, 2):
            if not row:
                continue
            if len(row) != 2:
                raise DataError(f"{src / CSV_CAPTIONS}:{lineno}: expected 2 fields (image,caption), got {len(row)}")
            if row[1].strip():
                captions.setdefault(row[0].strip(), []).append(row[1].strip())
    return Source("csv", src / CSV_IMAGES, captions, _split_lists(splits_dir, "--splits"))


def _place(source: Path, target: Path, copy: bool) -> str:
    """Hard-link (or copy) source to target → "linked", "copied" or "kept" (a target of the same size stays)."""
    if target.is_file() and target.stat().st_size == source.stat().st_size:
        return "kept"
    target.unlink(missing_ok=True)
    if not copy:
        try:
            os.link(source, target)
            return "linked"
        except OSError as e:  # another file system (or mount), or links not allowed: copy
            logger.debug("%s: cannot link (%s), copying", source, e)
    shutil.copy2(source, target)
    return "copied"


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    with atomic_file(path) as f:
        f.write("".join(f"{line}\n" for line in lines).encode("utf-8"))


def convert(src: Path, dest: Path, splits_dir: Path | None = None, copy: bool = False) -> Path:
    """Write the project's layout of the download at `src` into `dest` (see the module's docstring)."""
    layout = layout_of(src)
    if layout == "project":
        raise DataError(f"{src} is in the project's layout already: check it with ./run data {src}")
    if dest.resolve() == src.resolve() or src.resolve() in dest.resolve().parents:
        raise DataError(f"DEST {dest} must lie outside SRC {src} (the source is only read)")
    source = read_official(src, splits_dir) if layout == "official" else read_csv_mirror(src, splits_dir)
    on_disk = {p.name for p in source.images.iterdir() if p.is_file()}
    keep = sorted(n for n in source.captions if n in on_disk)
    dropped = sorted(set(source.captions) - on_disk)
    logger.info("%s: the %s layout, %d images with captions (%d files in %s)", src, layout, len(keep), len(on_disk),
                source.images)
    if dropped:
        logger.warning("%d captioned names have no file in %s, their captions are left out: %s", len(dropped),
                       source.images, _names(dropped))
    (dest / "images").mkdir(parents=True, exist_ok=True)
    placed = Counter(_place(source.images / n, dest / "images" / n, copy)
                     for n in tqdm(keep, desc="images", unit="img", disable=len(keep) < 100))
    logger.info("%s: %d images: %d hard-linked, %d copied%s, %d there already", dest / "images", len(keep),
                placed["linked"], placed["copied"], "" if copy or not placed["copied"] else
                " (no link possible: another file system or mount)", placed["kept"])
    _write_lines(dest / "captions.txt", (f"{n}#{k}\t{' '.join(c.split())}" for n in keep
                                         for k, c in enumerate(source.captions[n])))
    for split, names in source.splits.items():
        _write_lines(dest / f"{split}.txt", names)
    logger.info("%s: captions.txt and %s written", dest, ", ".join(f"{s}.txt" for s in source.splits))
    return dest


@dataclass
class Report:
    """What the check found in a project-layout folder."""

    folder: Path
    images: int = 0
    captions: int = 0
    per_image: Counter[int] = field(default_factory=Counter)  # captions per image -> images
    splits: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the folder is not usable as it is
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _decode(path: Path) -> str | None:
    try:
        load_image(path, name=path.name)
    except ImageReadError as e:
        return str(e)
    return None


def check(root: Path, decode: bool = True) -> Report:
    """Check a project-layout folder (see the module's docstring); DataError if it lacks images/ or captions."""
    root = check_data_dir(root)
    report = Report(root)
    files = {p.name: p for p in (root / "images").iterdir() if p.is_file()}
    captions = read_captions(root / "captions.txt")
    report.images, report.captions = len(files), sum(map(len, captions.values()))
    report.per_image = Counter(len(captions.get(n, [])) for n in files)
    splits: dict[str, list[str]] = {}
    for split in SPLITS:
        if (root / f"{split}.txt").is_file():
            splits[split] = read_split_list(root / f"{split}.txt")
            report.splits[split] = len(splits[split])
        elif split in REQUIRED_SPLITS:
            report.errors.append(f"no {split}.txt (one image file name per line)")
    for split, names in splits.items():
        if len(set(names)) < len(names):
            report.warnings.append(f"{split}.txt names {len(names) - len(set(names))} images twice")
        if missing := set(names) - set(files):
            report.errors.append(f"{split}.txt: {len(missing)} images are not in images/: {_names(missing)}")
        if bare := (set(names) & set(files)) - set(captions):
            report.errors.append(f"{split}.txt: {len(bare)} images have no caption: {_names(bare)}")
    listed = set().union(*splits.values()) if splits else set()
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        if both := set(splits.get(a, ())) & set(splits.get(b, ())):
            report.errors.append(f"{len(both)} images are in both {a}.txt and {b}.txt: {_names(both)}")
    if unseen := set(captions) - set(files):
        report.warnings.append(f"captions.txt has captions of {len(unseen)} images not in images/: {_names(unseen)}")
    if uncaptioned := set(files) - set(captions):
        report.warnings.append(f"{len(uncaptioned)} files in images/ have no caption: {_names(uncaptioned)}")
    odd = {n: len(c) for n, c in captions.items() if n in files and len(c) != 5}
    if odd:
        report.warnings.append(f"{len(odd)} images have other than 5 captions: {_names(odd)}")
    private = [n for n, p in files.items() if not p.stat().st_mode & stat.S_IROTH]
    if private or not (root / "images").stat().st_mode & stat.S_IXOTH:
        report.warnings.append(f"{len(private)} images (or images/ itself) are not readable by other users: the "
                               f"Docker image's user (UID 10001 unless built with --build-arg UID=...) cannot read "
                               f"them: {_names(private)}")
    if decode:
        names = sorted(files)
        with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
            failures = {n: why for n, why in zip(names, tqdm(pool.map(_decode, (files[n] for n in names)),
                        total=len(names), desc="decoding", unit="img", disable=len(names) < 100), strict=True)
                        if why is not None}
        if bad := {n: w for n, w in failures.items() if n in listed}:
            report.errors.append(f"{len(bad)} images of the splits do not decode: "
                                 + "; ".join(list(bad.values())[:SHOWN]))
        if other := {n: w for n, w in failures.items() if n not in listed}:
            report.warnings.append(f"{len(other)} images outside the splits do not decode: {_names(other)}")
    return report


def log_report(report: Report) -> None:
    per_image = ", ".join(f"{n} captions: {k}" for n, k in sorted(report.per_image.items()))
    splits = ", ".join(f"{s} {n}" for s, n in report.splits.items())
    logger.info("%s: %d images, %d captions (images with %s), splits: %s", report.folder, report.images,
                report.captions, per_image or "none", splits or "none")
    for text in report.warnings:
        logger.warning("%s", text)
    for text in report.errors:
        logger.error("%s", text)
    if report.ok:
        logger.info("%s is usable: FRAGSEARCH_DATA=%s (or FRAGSEARCH_DATA_HOST for docker compose)", report.folder,
                    report.folder.resolve())


if __name__ == "__main__":  # `python -m fragsearch.model.flickr8k`, as the docs write it: the command's alias
    import sys

    from fragsearch.commands.data import main

    sys.exit(main())
