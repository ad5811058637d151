"""The watched folder: while the service runs, photos added to, changed in, moved within or deleted
from FRAGSEARCH_COLLECTION reach the index without a restart.

A thread follows the folder with `watchfiles` (inotify on Linux; polling where the file system
gives no events, e.g. some network mounts: FRAGSEARCH_WATCH_POLLING). Events are gathered for
`watch_debounce_ms` after the last one (a camera import of 500 files is one sync, not 500), then
applied by the same code as `./run index` (index/sync.py `sync_folder`: hashes, renames followed,
removals), under the engine's write lock, so uploads and deletes through the API never interleave
with it. Every `watch_rescan` seconds the folder is synced whether or not an event came: the
fallback for events a watcher cannot see (a folder mounted from elsewhere, a watch limit reached).
The backlog (files noticed, not yet applied) is on GET /readyz (`watch`) and /metrics
(`fragsearch_watch_backlog`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from watchfiles import Change, DefaultFilter, watch

from fragsearch.index.files import is_hidden
from fragsearch.index.sync import SyncReport
from fragsearch.model.imageio import IMAGE_SUFFIXES

logger = logging.getLogger(__name__)

JOIN_SECONDS = 10.0


class PhotoFilter(DefaultFilter):
    """Image files (by suffix), hidden files and folders left out, as the sync walks the folder."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __call__(self, change: Change, path: str) -> bool:
        p = Path(path)
        try:
            parts = p.relative_to(self.root).parts
        except ValueError:
            return False
        if is_hidden(*parts):
            return False
        # a folder (no suffix) passes: a removed folder comes as one event for the folder, and a new
        # folder's first files may land before the watcher follows it (the sync walks it whole)
        return p.suffix.lower() in IMAGE_SUFFIXES or not p.suffix


@dataclass
class WatchState:
    """What the watcher has seen and done (read by /readyz and /metrics)."""

    backlog: set[str] = field(default_factory=set)
    syncs: int = 0
    last_sync: float | None = None  # time.time() of the last sync that finished
    last_report: str = ""
    last_error: str | None = None
    watching: bool = False


class FolderWatcher:
    """Follows `folder` and calls `sync()` (which returns the SyncReport) after each debounced batch of
    events and at least every `rescan` seconds."""

    def __init__(self, folder: Path, sync: Any, debounce_ms: int = 1000, rescan: float = 300.0,
                 polling: bool = False) -> None:
        self.folder = Path(folder).resolve()
        self._sync = sync
        self.debounce_ms = debounce_ms
        self.rescan = rescan
        self.polling = polling
        self.state = WatchState()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="folder-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(JOIN_SECONDS)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = self.state
            return {"folder": str(self.folder), "watching": s.watching, "backlog": len(s.backlog), "syncs": s.syncs,
                    "last_sync": s.last_sync, "last_report": s.last_report, "last_error": s.last_error}

    def backlog(self) -> int:
        with self._lock:
            return len(self.state.backlog)

    def _run(self) -> None:
        last = time.monotonic()
        timeout_ms = max(1, int(min(self.rescan, 60.0) * 1000))  # wake up at least each minute to check the rescan
        while not self._stop.is_set():
            try:
                with self._lock:
                    self.state.watching = True
                for changes in watch(self.folder, watch_filter=PhotoFilter(self.folder), debounce=self.debounce_ms,
                                     stop_event=self._stop, rust_timeout=timeout_ms, yield_on_timeout=True,
                                     force_polling=self.polling or None, raise_interrupt=False):
                    if changes:
                        with self._lock:
                            self.state.backlog |= {path for _, path in changes}
                    due = time.monotonic() - last >= self.rescan
                    if changes or due:
                        self._apply("events" if changes else "periodic rescan")
                        last = time.monotonic()
            except Exception as e:  # the folder vanished, a watch limit: rescan periodically until it comes back
                logger.warning("watching %s failed (%s): falling back to a rescan every %.0fs", self.folder, e,
                               self.rescan)
                with self._lock:
                    self.state.watching = False
                    self.state.last_error = f"{type(e).__name__}: {e}"
                if self._stop.wait(self.rescan):
                    return
                self._apply("periodic rescan")
                last = time.monotonic()

    def _apply(self, why: str) -> None:
        with self._lock:
            taken = set(self.state.backlog)
        try:
            report: SyncReport = self._sync()
        except Exception as e:  # a full disk, an unreadable folder: kept in the backlog, tried again
            logger.exception("syncing the watched folder %s failed", self.folder)
            with self._lock:
                self.state.last_error = f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self.state.backlog -= taken
            self.state.syncs += 1
            self.state.last_sync = time.time()
            self.state.last_report = report.summary()
            self.state.last_error = None
        logger.info("watched folder (%s): %s", why, report.summary())
