"""The project's version, shown by --version and in the OpenAPI document (pyproject.toml reads it).

A new released model is a new version: RELEASED_MODEL names the sha256 of the released model's weights
(model/released/model.npz, as its manifest lists it) this version ships, and tests/test_release.py fails when
the release changes without both being set anew (and a CHANGELOG entry under the new version).
"""

__version__ = "0.4.0"
RELEASED_MODEL = "4a253ab4a1c456ff03e6b57fceb6f49e326e36d60b16d8a7bc3e9c1e8dd59d4a"
