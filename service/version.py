"""The project's version, shown by --version and in the OpenAPI document (pyproject.toml reads it).

A new released model is a new version: RELEASED_MODEL names the sha256 of the released model's weights
(model/released/model.npz, as its manifest lists it) this version ships, and tests/test_release.py fails when
the release changes without both being set anew (and a CHANGELOG entry under the new version).
"""

__version__ = "0.8.0"
RELEASED_MODEL = "2e94041e313f308e855844935404e4849a921169b9047bad88ca3c6344bcbd71"
