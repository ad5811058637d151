"""Where the runtime finds and keeps its files: a value the command that runs passes down.

`Places.artifacts` is what a fine-tuned backbone's relative path (``ImageConfig.backbone_weights``) is read
against; `Places.graphs` (``<cache>/graphs``) is the folder where exported graphs and trained region rankers
are looked for after the release folder, and where a missing graph is made. A command reads its settings once
(`Settings.places`) and hands this value to what it loads (`Bundle.load(..., places=...)`, the feature cache,
the extraction workers); nothing in the runtime reads the settings itself. `Places()` is the embedded default:
artifacts/ in a checkout, the user's data directory elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import platformdirs

ROOT = Path(__file__).resolve().parent.parent
# a checkout (the packages beside pyproject.toml) keeps its artifacts in artifacts/ and reads Flickr8K from
# ../shared/data/flickr8k; an installed package keeps both in the user's data directory
IN_CHECKOUT = (ROOT / "pyproject.toml").is_file() and (ROOT / "model" / "places.py").is_file()
USER_DATA = platformdirs.user_data_path("fragsearch", appauthor=False)
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "flickr8k" if IN_CHECKOUT else USER_DATA / "flickr8k"
DEFAULT_ARTIFACTS = ROOT / "artifacts" if IN_CHECKOUT else USER_DATA


@dataclass(frozen=True)
class Places:
    """The artifacts folder and the cache folder of one run (the `artifacts` and `cache` settings)."""

    artifacts: Path = DEFAULT_ARTIFACTS
    cache: Path = DEFAULT_ARTIFACTS / "cache"

    @property
    def graphs(self) -> Path:
        """Exported graphs and trained region rankers (after the release folder): ``<cache>/graphs``."""
        return self.cache / "graphs"

    def weights(self, weights: str) -> Path:
        """The file of a fine-tuned backbone (``ImageConfig.backbone_weights``): absolute, or relative to the
        artifacts folder; FileNotFoundError with the path if it is not there."""
        path = Path(weights)
        if not path.is_absolute():
            path = self.artifacts / path
        if not path.is_file():
            raise FileNotFoundError(f"backbone weights {weights!r} not found at {path}")
        return path


DEFAULT_PLACES = Places()
