"""The catalogue of an index folder: `index.sqlite`, one row per item and the `info` table.

`info` names the files and the candidate backend of the committed state; one SQLite transaction
(`Catalogue.commit`) is the commit point of every save (index.saving). Items are written with their
payload columns (the subclass's metadata) and their place in the re-rank store (segment, offset, n).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fragsearch.index.types import IndexLoadError

logger = logging.getLogger(__name__)

FORMAT = "fragsearch-index-1"
DB_FILE = "index.sqlite"
LOOKUP_CHUNK = 500  # values per `IN (...)` of a lookup


def connect(path: Path) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL journal, full fsync."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


def is_index(root: Path) -> bool:
    """Whether the folder holds a saved index (its catalogue database exists once the first save is made)."""
    return (Path(root) / DB_FILE).is_file()


def _created_info(root: Path, key: str) -> tuple[bool, Any]:
    """(readable, value) of an `info` key written once, when the index was created, read without a lock or
    -wal/-shm files (immutable); value None when the key is absent, readable False without a database."""
    if not is_index(root):
        return False, None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{Path(root) / DB_FILE}?mode=ro&immutable=1", uri=True)) as db:
            row = db.execute("SELECT value FROM info WHERE key = ?", (key,)).fetchone()
    except sqlite3.DatabaseError:
        return False, None
    return True, None if row is None else json.loads(row[0])


def built_fingerprint(root: Path) -> str | None:
    """The model fingerprint an index folder was built with; None when it has no readable database."""
    _, value = _created_info(root, "fingerprint")
    return None if value is None else str(value)


def built_backend(root: Path) -> str | None:
    """The candidate backend an index folder's committed `info` names (faiss when it names none); None when
    the folder has no readable database."""
    readable, value = _created_info(root, "backend")
    return None if not readable else "faiss" if value is None else str(value)


def set_aside_if_stale(root: Path, fingerprint: str, backend: str) -> Path | None:
    """Move an index folder built with another model (another `fingerprint`), or keeping its candidates in
    another backend than `backend`, to `<root>.stale` (one kept: an earlier one is replaced), so that it is
    built anew; returns where it went (None: nothing to set aside)."""
    built = built_fingerprint(root)
    if built is None:
        return None
    if built != fingerprint:
        why = f"was built with another model (fingerprint {built}, this model {fingerprint})"
    elif (kept := built_backend(root)) not in (None, backend):
        why = (f"keeps its candidates in {kept} and FRAGSEARCH_INDEX_BACKEND is {backend}"
               + (" (its Milvus collections stay on the server)" if kept == "milvus" else ""))
    else:
        return None
    stale = root.with_name(root.name + ".stale")
    logger.warning("%s %s: rebuilding it", root, why)
    shutil.rmtree(stale, ignore_errors=True)
    root.rename(stale)
    return stale


def committed_generation(root: Path) -> Any:
    """The committed generation in the folder's database now (None when it cannot be read)."""
    try:
        db = connect(Path(root) / DB_FILE)
        try:
            row = db.execute("SELECT value FROM info WHERE key = 'generation'").fetchone()
        finally:
            db.close()
        return None if row is None else json.loads(row[0])
    except (sqlite3.Error, json.JSONDecodeError):
        return None


def upgrade(db: sqlite3.Connection, columns: Sequence[tuple[str, str]]) -> None:
    """Add the payload columns a database made by an older version lacks, in one transaction (all or
    none; a concurrent opener that added them first is seen inside it). Added columns are NULL for the
    rows already there, so they must be nullable."""
    def lacking() -> list[tuple[str, str]]:
        have = {row[1] for row in db.execute("PRAGMA table_info(items)")}
        return [(name, kind) for name, kind in columns if name not in have]

    if not lacking():  # nothing to do: no write lock taken (a read-only folder opens as before)
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        missing = lacking()
        for name, kind in missing:
            db.execute(f"ALTER TABLE items ADD COLUMN {name} {kind}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    if missing:
        logger.info("upgraded the catalogue: added column(s) %s", ", ".join(name for name, _ in missing))


class StaleWriterError(RuntimeError):
    """Another writer committed since this copy was loaded: reload before writing."""


class Catalogue:
    """The SQLite database of one index folder: a writer connection and a reader connection."""

    def __init__(self, root: Path, columns: Sequence[tuple[str, str]], db: sqlite3.Connection) -> None:
        self.root = Path(root)
        self.columns = tuple(columns)
        self._db = db
        self._reader = sqlite3.connect(self.root / DB_FILE, check_same_thread=False, timeout=30.0)
        self._reader_lock = threading.Lock()

    # -- creation and snapshots -----------------------------------------------------------------------
    @classmethod
    def create(cls, root: Path, columns: Sequence[tuple[str, str]], info: dict[str, Any]) -> Catalogue:
        """A new database with the item table (payload `columns`: (name, SQL type)) and `info` rows."""
        root = Path(root)
        if (root / DB_FILE).exists():
            raise FileExistsError(f"an index already exists at {root}: load it, or choose another folder")
        root.mkdir(parents=True, exist_ok=True)
        db = connect(root / DB_FILE)
        cols = "".join(f", {name} {kind}" for name, kind in columns)
        base = {"format": FORMAT, "generation": 0, "next_id": 0, "created": time.time()}
        with db:
            db.execute("CREATE TABLE info (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute(f"CREATE TABLE items (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, seg INTEGER NOT NULL, "
                       f"off INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0{cols})")
            db.executemany("INSERT INTO info VALUES (?, ?)", ((k, json.dumps(v)) for k, v in {**base, **info}.items()))
        return cls(root, columns, db)

    @classmethod
    def open_snapshot(cls, root: Path, columns: Sequence[tuple[str, str]], what: str
                      ) -> tuple[Catalogue, dict[str, Any]]:
        """Open the database and start one read snapshot (`end_snapshot` ends it): (catalogue, info).
        IndexLoadError when it is missing, corrupt or unreadable."""
        root = Path(root)
        path = root / DB_FILE
        if not path.is_file():
            raise IndexLoadError(f"no {what} index at {root} ({DB_FILE} is missing); build one with: "
                                 f"python -m fragsearch.index.build")
        db: sqlite3.Connection | None = None
        try:
            db = connect(path)
            check = db.execute("PRAGMA quick_check").fetchone()
            if not check or check[0] != "ok":
                raise IndexLoadError(f"{path} is corrupt (SQLite integrity check: {check})")
            upgrade(db, columns)
            db.execute("BEGIN")  # one snapshot for every table read below: a writer may commit meanwhile
            info = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM info")}
        except (sqlite3.DatabaseError, json.JSONDecodeError) as e:
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            raise IndexLoadError(f"{path} is not a readable index database: {e}") from e
        except BaseException:
            if db is not None:
                db.close()
            raise
        return cls(root, columns, db), info

    def end_snapshot(self) -> None:
        self._db.execute("COMMIT")

    def item_rows(self) -> np.ndarray:
        """Every item row: (N, 5) int64 of id, seg, off, n, deleted, by id."""
        rows = self._db.execute("SELECT id, seg, off, n, deleted FROM items ORDER BY id").fetchall()
        return np.array(rows, dtype=np.int64).reshape(-1, 5)

    # -- the commit -----------------------------------------------------------------------------------
    def commit(self, generation: int, added: Iterable[tuple[Any, ...]], removed: Iterable[int],
               moved: Iterable[tuple[int, int, int]], info: dict[str, Any]) -> None:
        """One transaction: `added` item rows (id, n, seg, off, deleted, *payload columns), `removed`
        ids marked deleted, `moved` (seg, off, id) updates, `info` keys set. StaleWriterError when the
        committed generation is not `generation` (another writer saved since)."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            on_disk = int(json.loads(db.execute("SELECT value FROM info WHERE key='generation'").fetchone()[0]))
            if on_disk != generation:
                raise StaleWriterError(f"the index at {self.root} was saved by another writer (generation "
                                       f"{on_disk}, this copy has {generation}); reload it before writing")
            names = ", ".join(name for name, _ in self.columns)
            marks = ", ".join("?" for _ in self.columns)
            db.executemany(f"INSERT INTO items (id, n, seg, off, deleted, {names}) VALUES (?, ?, ?, ?, ?, {marks})",
                           added)
            db.executemany("UPDATE items SET deleted = 1 WHERE id = ?", ((i,) for i in removed))
            db.executemany("UPDATE items SET seg = ?, off = ? WHERE id = ?", moved)
            db.executemany("INSERT OR REPLACE INTO info (key, value) VALUES (?, ?)",
                           ((k, json.dumps(v)) for k, v in info.items()))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already (e.g. SQLITE_FULL)
                db.execute("ROLLBACK")
            raise

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database file."""
        with contextlib.suppress(sqlite3.DatabaseError):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # -- reads ----------------------------------------------------------------------------------------
    def payload_rows(self, ids: Sequence[int]) -> list[tuple[Any, ...]]:
        """(id, *payload columns) of the saved items `ids`."""
        names = ", ".join(name for name, _ in self.columns)
        out: list[tuple[Any, ...]] = []
        for start in range(0, len(ids), LOOKUP_CHUNK):
            part = list(ids[start : start + LOOKUP_CHUNK])
            marks = ", ".join("?" for _ in part)
            with self._reader_lock:
                out += self._reader.execute(f"SELECT id, {names} FROM items WHERE id IN ({marks})", part).fetchall()
        return out

    def lookup(self, column: str, values: Sequence[Any]) -> list[tuple[int, Any]]:
        """(id, value) of the saved, not deleted items whose payload `column` is one of `values`."""
        if column not in {name for name, _ in self.columns}:
            raise ValueError(f"no payload column {column!r}")
        out: list[tuple[int, Any]] = []
        for start in range(0, len(values), LOOKUP_CHUNK):
            part = list(values[start : start + LOOKUP_CHUNK])
            marks = ", ".join("?" for _ in part)
            with self._reader_lock:
                rows = self._reader.execute(
                    f"SELECT id, {column} FROM items WHERE deleted = 0 AND {column} IN ({marks})", part).fetchall()
            out += [(int(i), v) for i, v in rows]
        return out

    def select(self, columns: Sequence[str], where: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """(id, *columns) of the saved, not deleted items meeting the SQL condition `where` (on payload
        columns, with `?` placeholders for `params`)."""
        known = {name for name, _ in self.columns}
        if not set(columns) <= known:
            raise ValueError(f"no payload column among {sorted(set(columns) - known)}")
        names = "".join(f", {c}" for c in columns)
        with self._reader_lock:
            return self._reader.execute(f"SELECT id{names} FROM items WHERE deleted = 0 AND ({where})",
                                        list(params)).fetchall()

    def update_columns(self, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]) -> None:
        """Set payload `columns` of saved items in one transaction: rows are (*values, id). For metadata
        that no search structure depends on (the commit point of the index's structure stays `commit`)."""
        known = {name for name, _ in self.columns}
        if not set(columns) <= known:
            raise ValueError(f"no payload column among {sorted(set(columns) - known)}")
        sets = ", ".join(f"{c} = ?" for c in columns)
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(f"UPDATE items SET {sets} WHERE id = ?", rows)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()
        with self._reader_lock:
            self._reader.close()
