"""A model's fingerprint: which weights and settings produced an index's vectors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from typing import Any

import numpy as np

from fragsearch.model.bundle import Bundle
from fragsearch.model.config import IMAGE_FIELDS_ADDED_LATER

_cache: weakref.WeakKeyDictionary[Bundle, str] = weakref.WeakKeyDictionary()

# settings added after indexes were built: left out at their default, so that a model which does not use them keeps
# the fingerprint its indexes were built with (a merged model's blocks, the S_kl's pooling over ranks, a model's own
# top layers of MiniLM, the pass the sentence vector is read from; the image settings' list is the feature cache's
# too, with the side large pictures are read at among them: it changes the features of pictures larger than it only,
# whose cache entries it keys apart)
LATER = {"model": ("blocks", "pool_ranks", "text_layers"), "image": IMAGE_FIELDS_ADDED_LATER,
         "text": ("sentence_pass",)}


def _settings(part: str, cfg: Any) -> dict[str, object]:
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in LATER[part]}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if not (k in defaults and v == defaults[k])}


def model_fingerprint(bundle: Bundle) -> str:
    """sha256 (first 20 hex digits) of the model's settings, relations, word table and weights, and of its
    calibration's local scale where it has one."""
    cached = _cache.get(bundle)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    stored = {f"enc/{k}": v for k, v in bundle.encoders.arrays().items()}
    if bundle.text.cfg.word_vectors == "static" or bundle.is_global:  # the table's vectors, where it reads them
        stored["word_vectors"] = bundle.text.words.vectors
    settings = {
        "model": _settings("model", bundle.cfg),
        "image": _settings("image", bundle.image_cfg),
        "text": _settings("text", bundle.text.cfg),
        "relations": list(bundle.text.relations.kept),
        "words": len(bundle.text.words),
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update("\0".join(bundle.text.words.words).encode())
    if "word_vectors" in stored:
        h.update(np.ascontiguousarray(stored["word_vectors"], dtype=np.float32).tobytes())
    for name, array in sorted((k[4:], v) for k, v in stored.items() if k.startswith("enc/")):
        h.update(name.encode())
        h.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    cal = bundle.calibration
    if cal is not None and cal.local_power > 0:  # a local scale (added later) divides every stored vector too:
        # its settings and the references' own spreads it reads
        h.update(json.dumps({"local_k": cal.local_k, "local_power": cal.local_power}, sort_keys=True).encode())
        for own in (cal.ref_image_scales, cal.ref_sentence_scales):
            h.update(np.ascontiguousarray(own, dtype=np.float32).tobytes())
    digest = h.hexdigest()[:20]
    _cache[bundle] = digest
    return digest
