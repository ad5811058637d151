"""The documentation cannot drift from the code: the API reference is the one generated from the
OpenAPI document (the settings table: tests/test_settings.py), the changelog names the version the
service prints, and the site builds with `mkdocs build --strict` (a broken link, a missing page or
a missing anchor fails it)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fragsearch.commands.options import settings_markdown
from fragsearch.service.openapi_doc import api_files
from fragsearch.service.version import __version__
from fragsearch.settings import CONCERNS, Settings

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material"))
# skipped where mkdocs is absent, but failed under CI: the dev lock carries mkdocs and mkdocs-material
needs_mkdocs = pytest.mark.required(MKDOCS, reason="mkdocs or mkdocs-material is not installed (pip install "
                                    "mkdocs mkdocs-material; the dev lock carries them)")


def test_every_setting_has_a_row_and_a_description() -> None:
    """The table itself is checked against the model by tests/test_settings.py."""
    rows = re.findall(r"^\| `(\w+)` \|", settings_markdown(), flags=re.M)
    assert rows == [name for names in CONCERNS.values() for name in names]  # by concern
    assert sorted(rows) == sorted(Settings.model_fields)
    missing = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"settings without a description: {missing}"


def test_the_api_reference_is_written_where_the_docs_are() -> None:
    """`python -m fragsearch.service.openapi_doc` writes into the repository's docs/api, the files checked below."""
    from fragsearch.commands.api_docs import DEFAULT_OUT

    assert DEFAULT_OUT == ROOT / "docs" / "api" and (DEFAULT_OUT / "reference.md").is_file()


def test_the_api_reference_is_the_services_openapi_document() -> None:
    for name, text in api_files().items():
        committed = (ROOT / "docs" / "api" / name).read_text()
        assert committed == text, f"docs/api/{name} differs from the service's: " \
                                    "python -m fragsearch.service.openapi_doc"


def test_the_api_reference_shows_every_operation_and_its_examples() -> None:
    reference = api_files()["reference.md"]
    for route in ("POST /search/images", "POST /annotate", "POST /search/fragments", "POST /search/similar",
                  "POST /explain", "POST /images", "DELETE /images/{image_id}", "GET /readyz"):
        assert f"## `{route}`" in reference, route
    assert reference.count("Example of a 200 answer") >= 5 and '"sentence": "a dog runs on the grass"' in reference


def test_the_changelog_starts_with_the_version_the_service_prints() -> None:
    versions = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    released = [v for v in versions if v != "Unreleased"]
    assert released and released[0] == __version__, (versions, __version__)
    out = subprocess.run([sys.executable, "-m", "fragsearch.service", "--version"], cwd=ROOT, capture_output=True,
                         text=True,
                         timeout=120)
    assert out.stdout.split() == ["fragsearch", __version__]


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@needs_mkdocs
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    r = mkdocs_build(ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stderr[-4000:]
    for page in ("index.html", "results/index.html", "operations/settings/index.html", "api/reference/index.html",
                 "changelog/index.html", "screenshots/service-shapes.png", "results/flickr8k-dev.csv"):
        assert (tmp_path / "site" / page).is_file(), page
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert f"{__version__}" in changelog and "--8&lt;--" not in changelog  # the snippet was included


@needs_mkdocs
def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, copy / name)
    page = copy / "docs" / "guide" / "photos.md"
    page.write_text(page.read_text() + "\nSee [the missing page](nowhere.md).\n")
    r = mkdocs_build(copy, tmp_path / "site")
    assert r.returncode != 0 and "nowhere.md" in r.stderr, r.stderr[-2000:]
