"""A model's fingerprint: which weights and settings produced an index's vectors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref

import numpy as np
import torch

from model.bundle import Bundle

_cache: weakref.WeakKeyDictionary[Bundle, str] = weakref.WeakKeyDictionary()


def model_fingerprint(bundle: Bundle) -> str:
    """sha256 (first 20 hex digits) of the model's settings, relations, word table and weights."""
    cached = _cache.get(bundle)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    settings = {
        "model": bundle.model.cfg.to_dict(),
        "image": dataclasses.asdict(bundle.image_cfg),
        "text": dataclasses.asdict(bundle.text.cfg),
        "relations": list(bundle.text.relations.kept),
        "words": len(bundle.text.words),
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update("\0".join(bundle.text.words.words).encode())
    h.update(np.ascontiguousarray(bundle.text.words.vectors, dtype=np.float32).tobytes())
    for name, tensor in sorted(bundle.model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    digest = h.hexdigest()[:20]
    _cache[bundle] = digest
    return digest
