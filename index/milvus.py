"""Milvus as the candidate backend: one row per fragment in a collection, searched per query fragment.

A row: `id` (the fragment id, item · 2^10 + row, the primary key), `item` (the image or sentence
id) and `vector` (FLOAT_VECTOR, inner product). The URI chooses the server: a Milvus server or
cluster ("http://host:19530"), or milvus-lite ("path/file.db": a gRPC server in this process,
listening on 127.0.0.1 only; by default `milvus.db` inside the index folder). The same code runs
against both. Candidates come from Milvus; the score stays the exact S_kl of model.score over the
re-rank store (index.ranker), as with FAISS.

`IndexShape.kind` (an index's `IndexSettings.shape`) maps onto Milvus index types: flat → FLAT,
hnsw → HNSW (hnsw_m, ef_construction, ef_search), ivf → IVF_FLAT (nlist, nprobe), ivfpq → IVF_PQ
(nlist, m, nbits, nprobe; a Milvus server: milvus-lite has no IVF_PQ). A FAISS pre-transform has no Milvus counterpart.

Image candidates are the k' nearest *images* per query fragment (each by its best fragment), where
FAISS gives the k' nearest fragments: grouped by the server (`group_by_field="item"`) from Milvus
2.4 on; a 2.3 server ignores `group_by_field` without an error (it returns plain fragment hits,
items repeated), so there the backend groups the fragment hits itself: it asks for k' · GROUP_FETCH
fragments, keeps each item's first (best) hit, and asks again for four times as many for a query
whose hits were all used up before k' items were found. The first k' distinct items of a hit list
sorted by score are exactly the k' items with the best fragment scores, so both give the same items.
The server's version is read when the backend opens; servers older than 2.3 (no upsert, no range
search) are refused, naming the minimum. Milvus returns at most 16,384 results per query
(`MAX_TOPK`): larger k' are cut to it, and k' = 0 (every positive fragment) is a range search with
radius 0 capped at the same number.

Consistency: a search sees every write this backend made and everything committed before it
opened. After each write (and at open) the backend asks the server for a timestamp (AllocTimestamp,
which comes after the write's own) and searches with that guarantee timestamp ("Customized"
consistency): the server answers once its query nodes have applied everything up to it. The first
search after a write waits for the server's next time tick (about 200 ms on 2.3.5), later ones do
not wait (2-5 ms); "Strong" would wait on every search, and "Session" or "Bounded" may still return
a row deleted a moment ago (a 2.3 server returns no timestamp for a delete, so pymilvus's Session
has none to wait for). milvus-lite, which applies writes before it answers and has no
AllocTimestamp, searches at the collection's level, Strong.

Crash safety: the collection always holds every row of the committed state. Additions reach the
collection before the catalogue commits them; removals wait for the commit (until then the backend's
searches leave the removed rows out by a filter, and its count leaves them out), so a writer or a
server killed at any moment cannot take a committed item's rows away. Before the first change after
a commit, a marker file is made in the index folder (fsynced); it is removed once the commit's
removals reached the server. The first write after a load that finds the marker (a writer died after
touching Milvus, before its commit or before its removals were sent) deletes the rows of items the
catalogue never committed and, when the count still differs from the committed state (removals not
sent) or fragments are shared, refills the collection from the re-rank store. Rows of uncommitted or
removed items that a search meets meanwhile are dropped by the ranker, which keeps live items only.
A rebuild fills a new collection; the commit names it and the old one is dropped.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fragsearch.index import ids as fid
from fragsearch.index.candidates import CandidateBackend, Sources
from fragsearch.index.types import BackendOptions, IndexFullError, IndexLoadError, IndexSettings
from fragsearch.model.atomic import fsync_dir

logger = logging.getLogger(__name__)

LITE_FILE = "milvus.db"  # the default milvus-lite folder inside an index folder
DIRTY_MARKER = ".milvus-uncommitted"
COLLECTION_PREFIX = "fragsearch"
MAX_TOPK = 16_384  # Milvus's limit on results per query
INSERT_ROWS = 4096  # rows per insert call
ID, ITEM, VECTOR = "id", "item", "vector"
MIN_SERVER = (2, 3, 0)  # the oldest Milvus server supported: upsert and the range search arrived in 2.3
GROUPING_SERVER = (2, 4, 0)  # the first server that groups hits by a field (group_by_field)
GROUP_FETCH = 8  # fragment hits asked per item wanted, where the backend groups hits itself

_lite_lock = threading.Lock()
_lite_users: dict[str, int] = {}  # milvus-lite folder -> open backends in this process


@contextlib.contextmanager
def _space(root: Path) -> Iterator[None]:
    """A write the server refused for want of disk space (milvus-lite writes into the index folder)
    becomes IndexFullError, as a full disk during a save does."""
    try:
        yield
    except Exception as e:
        if os.strerror(errno.ENOSPC) in str(e) and not isinstance(e, OSError):
            raise IndexFullError(root, e) from e
        raise


def is_lite(uri: str) -> bool:
    """A milvus-lite folder (pymilvus starts a local server for URIs ending in .db)."""
    return uri.endswith(".db")


def index_spec(settings: IndexSettings) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(Milvus index type, build params, search params) for `settings`; ValueError when it has no
    Milvus counterpart."""
    if settings.shape.pretransform:
        raise ValueError(f"Milvus has no pre-transform ({settings.shape.pretransform!r}): leave it out with --backend "
                         "milvus (use ivfpq's m for compression)")
    if settings.shape.kind == "flat":  # float32 vectors whatever candidate_dtype says (a FAISS flat index's copy)
        return "FLAT", {}, {}
    if settings.shape.kind == "hnsw":
        return "HNSW", {"M": settings.shape.hnsw_m,
                        "efConstruction": settings.shape.ef_construction}, {"ef": settings.search.ef_search}
    if settings.shape.kind == "ivf":
        return "IVF_FLAT", {"nlist": settings.shape.nlist}, {"nprobe": settings.search.nprobe}
    return ("IVF_PQ", {"nlist": settings.shape.nlist, "m": settings.shape.m, "nbits": settings.shape.nbits},
            {"nprobe": settings.search.nprobe})


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a Milvus server's version string ("v2.3.5", "v2.4.1-gpu", "2.5.0"),
    or None when it has none."""
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not found:
        return None
    return int(found[1]), int(found[2]), int(found[3] or 0)


def groups_on_server(uri: str, version: str) -> bool:
    """Whether the server at `uri` (its version string `version`) groups hits by item itself
    (milvus-lite and servers from 2.4); ValueError for a server older than MIN_SERVER. A version that
    cannot be read is grouped here, which is right on every server."""
    if is_lite(uri):
        return True
    parsed = parse_version(version)
    if parsed is None:
        logger.warning("Milvus at %s reports version %r: grouping candidates by item in fragsearch", uri, version)
        return False
    if parsed < MIN_SERVER:
        raise ValueError(f"Milvus at {uri} is version {version}; fragsearch needs a Milvus server "
                         f"{'.'.join(map(str, MIN_SERVER))} or newer (2.4 or newer groups candidates on the "
                         "server): upgrade the server")
    return parsed >= GROUPING_SERVER


def _where(root: Path, uri: str | None) -> tuple[str, str]:
    """(URI to connect to, URI to record in the catalogue): "" records the default lite folder."""
    if not uri:
        return str(Path(root).resolve() / LITE_FILE), ""
    if is_lite(uri):
        return str(Path(uri).resolve()), str(Path(uri).resolve())
    return uri, uri


class DirtyMarker:
    """The marker file that says a collection may hold writes no commit names (the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / DIRTY_MARKER
        self.marked = self.path.exists()

    def mark(self) -> None:
        """Before the first change after a commit."""
        if not self.marked:
            self.path.touch()
            fsync_dir(self.path.parent)
            self.marked = True

    def clear(self) -> None:
        """After a commit."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fsync_dir(self.path.parent)
        self.marked = False


def make_collection(client: Any, name: str, dim: int, settings: IndexSettings) -> None:
    """A new, loaded collection of fragment rows with the vector index `settings` map to."""
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(ID, DataType.INT64, is_primary=True)
    schema.add_field(ITEM, DataType.INT64)
    schema.add_field(VECTOR, DataType.FLOAT_VECTOR, dim=dim)
    index_type, build, _ = index_spec(settings)
    params = client.prepare_index_params()
    # build parameters as one JSON "params" entry: what Milvus servers accept and milvus-lite reads
    # (pymilvus would otherwise send each as its own key, which milvus-lite ignores)
    params.add_index(field_name=VECTOR, index_type=index_type, metric_type="IP", params={"params": build})
    client.create_collection(name, schema=schema, index_params=params, consistency_level="Strong")
    client.load_collection(name)


def consistency(guarantee: int) -> dict[str, Any]:
    """Request arguments that make a read see every write before the server timestamp `guarantee`
    (0: the collection's level, Strong)."""
    return {"consistency_level": "Customized", "guarantee_timestamp": guarantee} if guarantee else {}


def stored_count(client: Any, name: str, guarantee: int = 0, where: str = "") -> int:
    """Rows held by a collection, or its rows matching the filter expression `where` (read back from
    the server, after the writes before `guarantee`)."""
    rows = client.query(name, filter=where, output_fields=["count(*)"], **consistency(guarantee))
    return int(rows[0]["count(*)"]) if rows else 0


def among(field: str, values: Iterable[int], negate: bool = False) -> str:
    """The filter expression `field in [v, ...]` (`not in` with `negate`)."""
    return f"{field} {'not in' if negate else 'in'} [{', '.join(str(int(v)) for v in values)}]"


def search_collection(client: Any, name: str, queries: np.ndarray, limit: int, params: dict[str, Any],
                      group: bool = False, items: np.ndarray | None = None, guarantee: int = 0,
                      where: str = "") -> list[list[dict[str, Any]]]:
    """Inner-product hits per query, best first (grouped by the server: each item once, by its best
    fragment); with `items`, among those items' fragments only, and with `where` among the rows that
    filter expression keeps (filters Milvus applies while it searches); after the writes before the
    server timestamp `guarantee` (0: Strong)."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    extra: dict[str, Any] = {"group_by_field": ITEM} if group else {}
    extra.update(consistency(guarantee))
    terms = ([among(ITEM, items)] if items is not None else []) + ([where] if where else [])
    if terms:
        extra["filter"] = " and ".join(f"({t})" for t in terms) if len(terms) > 1 else terms[0]
    result: list[list[dict[str, Any]]] = client.search(
        name, data=list(q), limit=limit, anns_field=VECTOR, search_params={"metric_type": "IP", "params": params},
        output_fields=[], **extra)
    return result


def first_items(hits: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The first hit of each of the first k distinct items of `hits` (sorted best first): the k items
    with the best fragment scores, each by its best fragment."""
    seen: dict[int, dict[str, Any]] = {}
    for hit in hits:
        item = int(hit["id"]) >> fid.FRAGMENT_BITS
        if item not in seen:
            seen[item] = hit
            if len(seen) == k:
                break
    return list(seen.values())


class MilvusCandidates(CandidateBackend):
    """Fragment vectors in one Milvus collection."""

    NAME = "milvus"

    def __init__(self, root: Path, uri: str, stored_uri: str, prefix: str, collection: str, dim: int,
                 settings: IndexSettings, token: str | None) -> None:
        from pymilvus import MilvusClient

        self.root = Path(root)
        self.uri, self.stored_uri, self.prefix = uri, stored_uri, prefix
        self.collection = collection
        self.dim = dim
        self.settings = settings
        self.token = token
        self._index_type, _, self._search_params = index_spec(settings)
        if is_lite(uri):
            with _lite_lock:
                _lite_users[uri] = _lite_users.get(uri, 0) + 1
        self.client = MilvusClient(uri=uri, token=token or "")
        self._count = 0
        self.marker = DirtyMarker(self.root)
        self._closed = False
        self._committed = ""
        try:
            self.server_version = str(self.client.get_server_version())
            self.groups_on_server = groups_on_server(uri, self.server_version)
        except BaseException:
            self.close()
            raise
        self._guarantee = 0
        self._gone_items: list[int] = []  # removed items whose rows wait for the commit
        self._gone_ids: list[int] = []  # removed rows (shared fragments) waiting for the commit
        self._seen()

    def _seen(self) -> None:
        """Reads from now on see every write made so far: the server's next timestamp becomes their
        guarantee (0 where the server has none to give; milvus-lite has none, and its reads are Strong)."""
        if not is_lite(self.uri):
            self._guarantee = int(self.client._get_connection().alloc_timestamp() or 0)

    # -- opening --------------------------------------------------------------------------------------
    @classmethod
    def create(cls, root: Path, dim: int, settings: IndexSettings, options: BackendOptions,
               kind: str) -> MilvusCandidates:
        index_type, _, _ = index_spec(settings)
        uri, stored = _where(root, options.uri)
        if is_lite(uri) and index_type == "IVF_PQ":
            raise ValueError("milvus-lite has no IVF_PQ index: use --kind ivf or hnsw, or a Milvus server (--uri)")
        prefix = f"{COLLECTION_PREFIX}_{kind}_{secrets.token_hex(6)}"
        out = cls(root, uri, stored, prefix, f"{prefix}_0", dim, settings, options.token)
        try:
            make_collection(out.client, out.collection, dim, settings)
        except BaseException:
            out.close()
            raise
        return out

    @classmethod
    def open(cls, root: Path, dim: int, settings: IndexSettings, info: dict[str, Any],
             options: BackendOptions | None) -> MilvusCandidates:
        stored = str(info.get("milvus_uri", ""))
        uri, _ = _where(root, (options.uri if options else None) or stored or None)
        collection, prefix = str(info.get("milvus_collection", "")), str(info.get("milvus_prefix", ""))
        try:
            out = cls(root, uri, stored, prefix, collection, dim, settings, options.token if options else None)
        except ValueError as e:  # an unsupported server version
            raise IndexLoadError(f"index at {root}: {e}") from e
        except Exception as e:
            raise IndexLoadError(f"index at {root}: cannot reach Milvus at {uri}: {e}") from e
        try:
            if not collection or not out.client.has_collection(collection):
                raise IndexLoadError(f"index at {root}: Milvus at {uri} has no collection {collection!r}: "
                                     "rebuild the index with python -m fragsearch.index.build --backend milvus")
            out.client.load_collection(collection)
            out._count = stored_count(out.client, collection, out._guarantee)
        except BaseException:
            out.close()
            raise
        out._committed = collection
        return out

    # -- state ------------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return self._count

    @property
    def active_kind(self) -> str:
        return self.settings.shape.kind

    @property
    def trained(self) -> bool:
        return True  # Milvus trains its index on each sealed segment itself

    @property
    def supports_remove(self) -> bool:
        return True

    def set_settings(self, settings: IndexSettings) -> None:
        self.settings = settings
        self._index_type, _, self._search_params = index_spec(settings)

    # -- writes -----------------------------------------------------------------------------------
    def add(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        if len(ids) == 0:
            return
        self.marker.mark()
        items = fid.decode(ids)[0]
        vecs = np.asarray(vecs, dtype=np.float32)
        for start in range(0, len(ids), INSERT_ROWS):
            end = start + INSERT_ROWS
            part = zip(ids[start:end].tolist(), items[start:end].tolist(), vecs[start:end], strict=True)
            rows = [{ID: int(i), ITEM: int(t), VECTOR: v} for i, t, v in part]
            with _space(self.root):
                self.client.upsert(self.collection, data=rows)
        self._count += len(ids)
        self._seen()

    def remove_item(self, item: int) -> int:
        """The item's rows leave searches and the count now, the collection at the commit."""
        n = stored_count(self.client, self.collection, self._guarantee, f"{ITEM} == {int(item)}")
        self._gone_items.append(int(item))
        self._count -= n
        return n

    def remove_ids(self, ids: np.ndarray) -> int:
        """As remove_item, for single rows."""
        todo = sorted(set(int(i) for i in ids) - set(self._gone_ids))
        if not todo:
            return 0
        n = stored_count(self.client, self.collection, self._guarantee, among(ID, todo))
        self._gone_ids.extend(todo)
        self._count -= n
        return n

    def _excluded(self) -> str:
        """The filter expression that leaves out the rows of removals not committed yet ("" when none)."""
        terms = ([among(ITEM, self._gone_items, negate=True)] if self._gone_items else []) + \
            ([among(ID, self._gone_ids, negate=True)] if self._gone_ids else [])
        return " and ".join(f"({t})" for t in terms) if len(terms) > 1 else "".join(terms)

    def _send_removals(self) -> None:
        """Delete the committed removals' rows from the collection (the marker stays until they are gone)."""
        if not self._gone_items and not self._gone_ids:
            return
        self.marker.mark()
        with _space(self.root):
            if self._gone_items:
                self.client.delete(self.collection, filter=among(ITEM, self._gone_items))
            if self._gone_ids:
                self.client.delete(self.collection, ids=list(self._gone_ids))
        self._gone_items, self._gone_ids = [], []
        self._seen()
        self._count = stored_count(self.client, self.collection, self._guarantee)

    def _delete(self, expr: str = "", ids: list[int] | None = None) -> int:
        """Delete by expression or ids; the count is read back (not every server reports it reliably)."""
        before = self._count
        with _space(self.root):
            self.client.delete(self.collection, filter=expr, ids=ids)
        self._seen()
        self._count = stored_count(self.client, self.collection, self._guarantee)
        return before - self._count

    def rebuilt(self, settings: IndexSettings, sources: Sources) -> MilvusCandidates:
        """A new collection of `settings` filled from the store (the current one stays until the commit)."""
        out = MilvusCandidates(self.root, self.uri, self.stored_uri, self.prefix,
                               f"{self.prefix}_{secrets.token_hex(4)}", self.dim, settings, self.token)
        out.marker.marked = self.marker.marked
        out._committed = self._committed
        try:
            make_collection(out.client, out.collection, out.dim, settings)
            out._fill(sources)
        except BaseException:
            out.discard()
            raise
        return out

    def _fill(self, sources: Sources) -> None:
        with tqdm(total=sources.total, desc=f"Milvus {self._index_type}", unit="frag",
                  disable=sources.total < 50_000, leave=False) as bar:
            for ids, vecs in sources.batches():
                self.add(ids, vecs)
                bar.update(len(ids))
        self.client.flush(self.collection)

    def reconcile(self, next_id: int, expected: int, sources: Sources) -> None:
        """See the module docstring: rows of uncommitted items go; a count that still differs (or
        shared fragments, whose representatives may have moved) refills the collection."""
        if not self.marker.marked:
            return
        self._delete(f"{ITEM} >= {next_id}")
        shared = expected != sources.total  # the entries are representatives of shared vectors
        if self._count == expected and not shared:
            logger.info("Milvus collection %s holds the committed state", self.collection)
            return
        logger.warning("Milvus collection %s holds %d fragments, the committed state %d: refilling it from the "
                       "re-rank store", self.collection, self._count, expected)
        self.client.drop_collection(self.collection)
        make_collection(self.client, self.collection, self.dim, self.settings)
        self._count = 0
        self._fill(sources)

    # -- search -----------------------------------------------------------------------------------
    def _hits(self, queries: np.ndarray, k: int, group: bool, items: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        k = max(1, min(k, MAX_TOPK, max(1, self._count)))
        params = dict(self._search_params)
        if "ef" in params:
            params["ef"] = max(int(params["ef"]), k)  # HNSW's beam must cover k
        if group and not self.groups_on_server:
            results = self._grouped_here(queries, k, params, items)
        else:
            results = search_collection(self.client, self.collection, queries, k, params, group, items,
                                        self._guarantee, self._excluded())
        scores = np.zeros((len(queries), k), np.float32)
        ids = np.full((len(queries), k), -1, np.int64)
        for row, hits in enumerate(results):
            for col, hit in enumerate(hits[:k]):
                scores[row, col], ids[row, col] = float(hit["distance"]), int(hit["id"])
        return scores, ids

    def _grouped_here(self, queries: np.ndarray, k: int, params: dict[str, Any], items: np.ndarray | None
                      ) -> list[list[dict[str, Any]]]:
        """Per query, the k items with the best fragment scores, each by its best fragment, grouped from
        fragment hits (a server that does not group): k · GROUP_FETCH hits first, four times as many
        again for the queries whose hits ran out before k items (up to MAX_TOPK or every fragment)."""
        cap = max(1, min(MAX_TOPK, self._count))
        rows = np.asarray(queries)
        out: list[list[dict[str, Any]]] = [[] for _ in range(len(queries))]
        todo = list(range(len(queries)))
        limit = min(cap, k * GROUP_FETCH)
        while todo:
            round_params = dict(params)
            if "ef" in round_params:
                round_params["ef"] = max(int(round_params["ef"]), limit)
            found = search_collection(self.client, self.collection, rows[todo], limit, round_params,
                                      items=items, guarantee=self._guarantee, where=self._excluded())
            again = []
            for q, hits in zip(todo, found, strict=True):
                out[q] = first_items(hits, k)
                if len(out[q]) < k and len(hits) >= limit and limit < cap:
                    again.append(q)
            todo, limit = again, min(cap, limit * 4)
        return out

    def search(self, queries: np.ndarray, k: int, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._hits(queries, k, group=False, items=items)

    def search_items(self, queries: np.ndarray, k: int, items: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The k nearest items per query fragment (grouped by `item`, each by its best fragment)."""
        return self._hits(queries, k, group=True, items=items)

    def search_positive(self, queries: np.ndarray, items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if self._count == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        params = {**self._search_params, "radius": 0.0}
        results = search_collection(self.client, self.collection, queries, min(MAX_TOPK, self._count),
                                    params, items=items, guarantee=self._guarantee, where=self._excluded())
        scores = np.asarray([float(h["distance"]) for hits in results for h in hits], np.float32)
        ids = np.asarray([int(h["id"]) for hits in results for h in hits], np.int64)
        keep = scores > 0
        return scores[keep], ids[keep]

    # -- persistence ------------------------------------------------------------------------------
    def persist(self, root: Path, generation: int, created: list[Path]) -> dict[str, Any]:
        with _space(self.root):
            self.client.flush(self.collection)
        return {"backend": self.NAME, "milvus_uri": self.stored_uri, "milvus_prefix": self.prefix,
                "milvus_collection": self.collection, "ann_file": "", "ann_sha256": "", "ann_trained": True,
                "ann_ntotal": self._count}

    def committed(self, info: dict[str, Any]) -> None:
        """After the catalogue's commit: its removals reach the server, then the marker goes. A server
        that refuses them leaves the marker (the next load's first write reconciles) and the removals
        waiting for the next commit."""
        self._committed = str(info["milvus_collection"])
        try:
            self._send_removals()
        except Exception as e:  # the commit stands: the rows stay out of searches and are sent again
            logger.warning("Milvus collection %s: the commit's removals did not reach the server (%s); sent again "
                           "at the next save", self.collection, e)
            return
        self.marker.clear()

    def keeps(self) -> set[str]:
        return set()

    def drop_unreferenced(self) -> None:
        """Drop this index's collections that the commit does not name (a rebuild's old one, or one
        a crashed rebuild left)."""
        for name in self.client.list_collections():
            if name.startswith(self.prefix + "_") and name != self._committed:
                logger.info("dropping Milvus collection %s (no longer named by the index)", name)
                self.client.drop_collection(name)

    def discard(self) -> None:
        """Drop this collection (a rebuild replaced it, or a rebuild failed while filling it)."""
        if not self._closed:
            self.client.drop_collection(self.collection)
        self.close()

    def close(self) -> None:
        """Close the client; the last user of a milvus-lite folder in this process stops its server."""
        if self._closed:
            return
        self._closed = True
        self.client.close()
        if is_lite(self.uri):
            with _lite_lock:
                left = _lite_users[self.uri] = _lite_users.get(self.uri, 1) - 1
                if left <= 0:
                    del _lite_users[self.uri]
            if left <= 0:
                from milvus_lite.server_manager import server_manager_instance

                server_manager_instance.release_server(self.uri)
