"""The project's version, shown by --version and in the OpenAPI document (pyproject.toml reads it).

A new released model is a new version: RELEASED_MODEL names the sha256 of the released model's weights
(model/released/model.npz, as its manifest lists it) this version ships, and tests/test_release.py fails when
the release changes without both being set anew (and a CHANGELOG entry under the new version).
"""

__version__ = "0.2.0"
RELEASED_MODEL = "59f318f001e9a08ddc97c8d19af67af55deed501b725455af678c29f88532694"
