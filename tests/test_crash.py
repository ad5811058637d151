"""Crash consistency, tested on real processes and a real file system.

A writer process (tests/crash_writer.py: adds, removes, saves, builds of the candidate index) is
killed with SIGKILL at random moments; after each kill the index must load and hold exactly the
state of a completed commit: the live items and their names as journalled before that commit, one
catalogue row per live item, exactly the live fragments in the candidate backend (the FAISS file; a
Milvus collection once the first write has reconciled it) and the store, and a search through the
candidates that ranks every live item as the exact scan does. On FAISS and on milvus-lite.
Also: two writer processes on one index, a crash between commit and clean-up, removals racing
searches, uploads at the same time as each other and as a delete, and a save on a full disk.

    pytest tests/test_crash.py                 # the crash between commit and clean-up, two writers, races, full disk
    pytest tests/test_crash.py -m slow         # random kills: a few on each backend, then 60
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import httpx
import numpy as np
import pytest

from fragsearch.index import ImageIndex, IndexFullError, IndexSettings
from fragsearch.index import ids as fid
from fragsearch.index.ann import FaissCandidates
from fragsearch.index.images import embedded_images
from fragsearch.index.milvus import ID as MILVUS_ID
from fragsearch.index.milvus import MAX_TOPK as MILVUS_MAX_TOPK
from fragsearch.index.milvus import MilvusCandidates
from fragsearch.index.types import BackendOptions
from fragsearch.model.embed import EmbeddedSentence
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from tests.crash_writer import journal_state, live_items, random_images
from tests.test_index import ranking, recall_all

if TYPE_CHECKING:
    from tests.conftest import ShapesModel
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

ROOT = Path(__file__).resolve().parent.parent
QUICK_KILLS = 5
MILVUS_KILLS = 3
SLOW_KILLS = 60
KILL_WITHIN = 1.5  # seconds after "ready" within which the kill lands (uniformly)
READY_TIMEOUT = 120.0


def start_writer(index: Path, model: Path, journal: Path, seed: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.crash_writer", "--index", str(index), "--model", str(model),
           "--journal", str(journal), "--seed", str(seed), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT
    line = proc.stdout.readline()
    if line.strip() != "ready" or time.monotonic() > deadline:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"writer did not start: {line!r} {err[-2000:]}")


def journal(path: Path) -> list[tuple[int, dict[int, str]]]:
    out = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        out.append((int(entry["gen"]), {int(i): n for i, n in entry["items"].items()}))
    return out


def backend_ids(index: ImageIndex) -> list[int]:
    """The fragment ids the candidate backend holds, sorted: the FAISS file's id map, or the rows of the
    Milvus collection."""
    cand = index.candidates
    if isinstance(cand, MilvusCandidates):
        rows = cand.client.query(cand.collection, filter=f"{MILVUS_ID} >= 0", output_fields=[MILVUS_ID],
                                 limit=MILVUS_MAX_TOPK)
        return sorted(int(r[MILVUS_ID]) for r in rows)
    assert isinstance(cand, FaissCandidates)
    flat: Any = faiss.downcast_index(cand.index)
    return sorted(faiss.vector_to_array(flat.id_map).tolist())


def check_committed_state(root: Path, shapes: ShapesModel, log: Path) -> int:
    """The index at root loads and holds exactly the journalled state of its generation; returns it.

    The candidate backend holds exactly the live fragments the catalogue names (a Milvus collection
    once the first write after the crash has reconciled it), and a search through the candidates,
    with k' beyond every fragment, ranks every live item as the exact score over all of them does."""
    entries = journal(log)
    index = ImageIndex.load(root, shapes.bundle)
    try:
        gen = index.generation
        last_intent = entries[-1][0]
        assert gen in (last_intent, last_intent - 1), f"generation {gen}, last journalled {last_intent}"
        expected = [items for g, items in entries if g == gen][-1]
        assert live_items(index) == expected, "not the state of a completed commit"
        ids = index.ids()
        # catalogue rows match: one live row per live item, with the right fragment count
        with sqlite3.connect(root / "index.sqlite") as db:
            rows = dict(db.execute("SELECT id, n FROM items WHERE deleted = 0").fetchall())
        assert set(rows) == set(ids.tolist())
        for i in ids.tolist():
            rec = index.get(int(i))
            assert rec is not None and len(rec.boxes) == rows[i]
        recall_all(index)
        probes = [int(ids[len(ids) // 2]), int(ids[0]), int(ids[-1])] if len(ids) else []
        if index.candidates.NAME == "milvus":
            # before the first write, the collection may still hold what the killed writer did not commit:
            # searches return committed items only
            for probe in probes:
                vecs, _ = index.stored.vectors(np.asarray([probe]))
                assert {h.image_id for h in index.search(EmbeddedSentence(vecs[0, :3].copy()),
                                                         len(ids)).hits} <= set(rows)
            journal_state(log, gen + 1, expected)
            index.save()  # the first write reconciles the collection with the committed state
        fragments = sorted(np.concatenate([fid.item_fragments(i, n) for i, n in rows.items()]).tolist())
        assert backend_ids(index) == fragments, f"{index.candidates.NAME} and the catalogue disagree"
        assert index.candidates.ntotal == index.n_fragments == sum(rows.values()), "the backend and the store disagree"
        # every live item is recalled and ranked by the exact score, as the scan over every item ranks it
        for probe in probes:
            vecs, _ = index.stored.vectors(np.asarray([probe]))
            query = vecs[0, :3].copy()
            hits = index.search(EmbeddedSentence(query), len(ids)).hits
            exact = index.search(EmbeddedSentence(query), len(ids), exhaustive=True).hits
            assert ranking(hits) == ranking(exact), "the candidates missed a live item"
        return gen
    finally:
        index.close()


@pytest.fixture
def crash_index(request: pytest.FixtureRequest, shapes_model: ShapesModel, tmp_path: Path) -> tuple[Path, Path]:
    """A flat image index with 8 random images, saved once, and the journal of its first state; its
    candidates in FAISS, or in Milvus (milvus-lite in the index folder) when parametrized so."""
    root = tmp_path / "index"
    backend = BackendOptions(getattr(request, "param", "faiss"))
    index = ImageIndex.create(root, shapes_model.bundle, IndexSettings(), backend=backend)
    vecs, boxes, sizes = random_images(np.random.default_rng(99), shapes_model.bundle.dim, 8)
    index.add(embedded_images(vecs, boxes, sizes), [f"seed-{i}.jpg" for i in range(8)], [f"/x/{i}" for i in range(8)],
              read_places=False)
    index.save()
    log = tmp_path / "journal.jsonl"
    journal_state(log, index.generation, live_items(index))
    index.close()
    return root, log


def kill_trials(shapes: ShapesModel, root: Path, log: Path, trials: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    gens = []
    for trial in range(trials):
        proc = start_writer(root, shapes.model_path, log, seed * 1000 + trial)
        wait_ready(proc)
        time.sleep(rng.uniform(0, KILL_WITHIN))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
        gens.append(check_committed_state(root, shapes, log))
    return gens


@pytest.mark.slow  # writer processes started and killed one after another: ./run test keeps the other crash checks
@pytest.mark.parametrize(("crash_index", "kills"), [("faiss", QUICK_KILLS), ("milvus", MILVUS_KILLS)],
                         indirect=["crash_index"])
def test_sigkill_during_writes_leaves_a_committed_state(shapes_model: ShapesModel, crash_index: tuple[Path, Path],
                                                        kills: int) -> None:
    """A writer process killed while it adds, removes, saves and rebuilds; with Milvus, the process
    killed is the one holding the milvus-lite folder (its server runs inside the writer)."""
    root, log = crash_index
    gens = kill_trials(shapes_model, root, log, kills, seed=1)
    assert gens[-1] > gens[0] or len(set(gens)) > 1, "the writers committed nothing before being killed"


@pytest.mark.slow
def test_sigkill_many_times(shapes_model: ShapesModel, crash_index: tuple[Path, Path]) -> None:
    root, log = crash_index
    gens = kill_trials(shapes_model, root, log, SLOW_KILLS, seed=2)
    assert len(set(gens)) > SLOW_KILLS // 4, "kills should land after many different commits"


def test_crash_between_commit_and_clean_up(shapes_model: ShapesModel, crash_index: tuple[Path, Path]) -> None:
    """Killed right after the commit: the new state is served, and the next save removes the files
    the dead writer no longer needed."""
    root, log = crash_index
    proc = start_writer(root, shapes_model.model_path, log, 5, "--die-after-commit")
    wait_ready(proc)
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert check_committed_state(root, shapes_model, log) == journal(log)[-1][0], "the commit happened"
    left = unreferenced(root)
    assert left, "the dead writer left files its commit no longer names (the clean-up never ran)"
    index = ImageIndex.load(root, shapes_model.bundle)
    index.remove(int(index.ids()[0]))
    index.save()
    assert not unreferenced(root), "the next save cleaned up what the dead writer left"
    assert not left & {p.name for p in root.iterdir()}
    index.close()


def unreferenced(root: Path) -> set[str]:
    """The store and FAISS files in the index folder that its committed state does not name."""
    with sqlite3.connect(root / "index.sqlite") as db:
        info = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM info")}
    referenced = {info["ann_file"]} | {s["file"] for s in info["segments"]}
    return {p.name for p in root.iterdir() if p.name.startswith(("faiss-", "store-"))} - referenced


def test_two_writer_processes_one_wins(shapes_model: ShapesModel, crash_index: tuple[Path, Path],
                                       tmp_path: Path) -> None:
    """Two processes write one index: the one that saves second is refused with a clear error and
    the index holds the state the other committed."""
    root, log = crash_index
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for j in logs:
        shutil.copy(log, j)
    procs = [start_writer(root, shapes_model.model_path, j, 40 + n, "--ops", "40", "--wait")
             for n, j in enumerate(logs)]
    for p in procs:  # both have loaded the same committed state before either writes
        wait_ready(p)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 3], (codes, [err[-3000:] for _, err in results])
    loser = codes.index(3)
    assert "saved by another writer" in results[loser][1]
    winner = 1 - loser
    assert check_committed_state(root, shapes_model, logs[winner]) == journal(logs[winner])[-1][0]


def test_removals_racing_searches(service_env: ServiceEnv, tmp_path: Path) -> None:
    """A removed image is never returned by a search that starts after its removal returned, and
    searches never fail while removals and saves run."""
    shutil.copytree(service_env.root / "images", tmp_path / "images")
    index = ImageIndex.load(tmp_path / "images", service_env.shapes.bundle)
    sentence = service_env.captions[service_env.dev[0]][0]
    removed: list[tuple[int, int]] = []  # (sequence number after the removal returned, id)
    seq = [0]
    lock = threading.Lock()
    failures: list[BaseException] = []
    stop = threading.Event()

    def tick() -> int:
        with lock:
            seq[0] += 1
            return seq[0]

    def searcher() -> None:
        try:
            while not stop.is_set():
                started = tick()
                hits = index.search(sentence, 50).hits
                gone = {i for s, i in list(removed) if s < started}
                assert not gone & {h.image_id for h in hits}, "a removed image was returned"
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=searcher) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for image_id in index.ids().tolist()[:10]:
            assert index.remove(int(image_id))
            removed.append((tick(), int(image_id)))
            index.save()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not failures, failures[0]
    index.close()
    reloaded = ImageIndex.load(tmp_path / "images", service_env.shapes.bundle)
    assert not {i for _, i in removed} & set(reloaded.ids().tolist())
    reloaded.close()


def test_uploads_at_once_and_an_upload_with_a_delete(service_env: ServiceEnv, tmp_path: Path) -> None:
    settings, engine = service_env.writable(tmp_path)
    app = create_app(settings, engine=engine)
    key = {"X-API-Key": service_env.api_key}
    victim = int(engine.images.ids()[0])

    def upload(c: httpx.AsyncClient, name: str) -> object:
        return c.post("/images", files={"file": (name, service_env.jpeg(service_env.dev[3]), "image/jpeg")},
                      headers=key)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            two = await asyncio.gather(upload(c, "one.jpg"), upload(c, "two.jpg"))  # type: ignore[arg-type]
            mixed = await asyncio.gather(upload(c, "three.jpg"), c.delete(f"/images/{victim}", headers=key))
            return [*two, *mixed]

    one, two, three, gone = asyncio.run(run())
    assert [r.status_code for r in (one, two, three)] == [201, 201, 201], [r.text for r in (one, two, three)]
    assert gone.status_code == 204
    ids = {r.json()["id"] for r in (one, two, three)}
    assert len(ids) == 3
    reloaded = ImageIndex.load(settings.image_index, service_env.shapes.bundle)
    live = set(reloaded.ids().tolist())
    assert ids <= live and victim not in live
    for r in (one, two, three):
        rec = reloaded.get(r.json()["id"])
        assert rec is not None and rec.name == r.json()["name"] and Path(rec.path).is_file()
    reloaded.close()


def _mount_tmpfs(target: Path, size: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _fill(folder: Path) -> Path:
    """Fill the file system of `folder` to the last byte (unbuffered writes); returns the filler file."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while f.write(b"\0" * size):
                    pass
    return filler


@pytest.fixture
def small_disk(tmp_path: Path) -> object:
    """A 16 MB tmpfs (needs the right to mount: root, or CAP_SYS_ADMIN); skipped otherwise."""
    target = tmp_path / "disk"
    if not _mount_tmpfs(target, "16m"):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root / CAP_SYS_ADMIN): full-disk test not run")
    yield target
    subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


def test_full_disk_during_save_keeps_the_last_good_state(service_env: ServiceEnv, small_disk: Path) -> None:
    bundle = service_env.shapes.bundle
    shutil.copytree(service_env.root / "images", small_disk / "images")
    shutil.copytree(service_env.root / "sentences", small_disk / "sentences")
    settings = service_env.settings_for(small_disk)
    engine = Engine(settings, bundle, ImageIndex.load(small_disk / "images", bundle), service_env.engine.sentences)
    before = live_items(engine.images)
    app = create_app(settings, engine=engine)
    filler = _fill(small_disk)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await c.post("/images", files={"file": ("full.jpg", service_env.jpeg(), "image/jpeg")},
                                headers={"X-API-Key": service_env.api_key})

    refused = asyncio.run(post())
    assert refused.status_code == 507, refused.text
    assert refused.json()["error"]["code"] == "insufficient_storage"
    assert "no space left" in refused.json()["error"]["message"]
    assert live_items(engine.images) == before, "the failed upload left nothing behind in memory"
    first = int(engine.images.ids()[0])
    assert engine.images.remove(first)  # a removal reaches the backend at the commit (Milvus too)
    with pytest.raises(IndexFullError, match="no space left"):
        engine.images.save()
    reloaded = ImageIndex.load(small_disk / "images", bundle)
    assert live_items(reloaded) == before, "the last good state survives on disk"
    reloaded.close()
    # with space again, the service writes again (the pending removal is saved with it)
    filler.unlink()
    added = asyncio.run(post())
    assert added.status_code == 201, added.text
    reloaded = ImageIndex.load(small_disk / "images", bundle)
    assert added.json()["id"] in set(reloaded.ids().tolist())
    assert len(reloaded) == len(before), "one removed, one added"
    reloaded.close()
    engine.images.close()

