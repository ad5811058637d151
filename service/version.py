"""The project's version, shown by --version and in the OpenAPI document (pyproject.toml reads it).

A new released model is a new version: RELEASED_MODEL names the sha256 of the released model's weights
(model/released/model.npz, as its manifest lists it) this version ships, and tests/test_release.py fails when
the release changes without both being set anew (and a CHANGELOG entry under the new version).
"""

__version__ = "0.5.0"
RELEASED_MODEL = "d3e81d307162068090b8244d804686be39e9dbb4e18d6257c621db33a5651ea0"
