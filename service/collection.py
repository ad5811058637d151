"""A photo collection's index as every command makes it: `fragsearch index` and the service's start read the same
settings (cache, workers, exclude, index kind, backend, device), so neither undoes what the other did."""

from __future__ import annotations

import dataclasses

from fragsearch.index.catalogue import set_aside_if_stale
from fragsearch.index.fingerprint import model_fingerprint
from fragsearch.index.sync import SAVE_EVERY, SyncReport, open_index, sync_folder
from fragsearch.index.types import IndexSettings
from fragsearch.model.bundle import Bundle
from fragsearch.model.device import device_name
from fragsearch.settings import Settings


def new_index_settings(settings: Settings, base: IndexSettings | None = None) -> IndexSettings:
    """The index settings of a new index: `base` (default IndexSettings()) with the `index_kind` setting's kind
    and the device the `device` setting names."""
    chosen = base or IndexSettings()
    return IndexSettings(dataclasses.replace(chosen.shape, kind=settings.index_kind),
                         dataclasses.replace(chosen.search, use_gpu=device_name(settings.device).startswith("cuda")))


def sync_collection(settings: Settings, bundle: Bundle, save_every: int = SAVE_EVERY) -> SyncReport:
    """Sync the `collection` setting's folder into its index (`image_index`, made when missing) as every
    command does it: `fragsearch index` and the service's start read the same settings (cache, workers,
    exclude, index kind, backend), so neither undoes what the other did."""
    folder = settings.collection
    if folder is None:
        raise ValueError("no collection folder is set")
    if not folder.is_dir():
        raise FileNotFoundError(f"the collection folder {folder} does not exist")
    # an index of an earlier model (a new release) is built anew: the features come back from the cache
    set_aside_if_stale(settings.image_index, model_fingerprint(bundle), settings.index_backend)
    index = open_index(settings.image_index, bundle, folder, settings.cache, new_index_settings(settings),
                       backend=settings.backend)
    try:
        return sync_folder(index, folder, workers=settings.worker_count, save_every=save_every,
                           exclude=settings.exclude)
    finally:
        index.close()

