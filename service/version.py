"""The project's version, shown by --version and in the OpenAPI document (pyproject.toml reads it).

A new released model is a new version: RELEASED_MODEL names the sha256 of the released model's weights
(model/released/model.npz, as its manifest lists it) this version ships, and tests/test_release.py fails when
the release changes without both being set anew (and a CHANGELOG entry under the new version).
"""

__version__ = "0.7.0"
RELEASED_MODEL = "c03284fccc40b76db4b71939218d9a8b26063d0d6fee1c325504306885fff961"
