"""The index's readers-writer lock (index/locks.py), on its own: readers share it, a writer holds it alone,
a waiting writer goes before readers that come after it, and an exception releases either side."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from fragsearch.index.locks import ReadWriteLock

WAIT = 10.0  # seconds a step may take before the test calls it stuck (never reached when the lock works)


def holder(lock: ReadWriteLock, side: str, log: list[str], name: str) -> tuple[threading.Thread, threading.Event,
                                                                            threading.Event]:
    """A thread that takes `side` of the lock, logs "<name> in", waits to be released, logs "<name> out"."""
    inside, release = threading.Event(), threading.Event()

    def run() -> None:
        with lock.read() if side == "read" else lock.write():
            log.append(f"{name} in")
            inside.set()
            assert release.wait(WAIT)
            log.append(f"{name} out")

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    return thread, inside, release


def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(int(WAIT / 0.01)):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the condition never held")


def waiting(lock: ReadWriteLock, writers: int = 0) -> Callable[[], bool]:
    return lambda: lock._waiting_writers == writers  # what the lock counts: a writer blocked in write()


def test_readers_share_the_lock() -> None:
    lock, log = ReadWriteLock(), []
    a, a_in, a_go = holder(lock, "read", log, "a")
    b, b_in, b_go = holder(lock, "read", log, "b")
    assert a_in.wait(WAIT) and b_in.wait(WAIT)  # both inside at once
    a_go.set()
    b_go.set()
    a.join(WAIT)
    b.join(WAIT)
    assert sorted(log) == ["a in", "a out", "b in", "b out"]


def test_a_writer_is_alone_and_goes_before_later_readers() -> None:
    lock, log = ReadWriteLock(), []
    r1, r1_in, r1_go = holder(lock, "read", log, "r1")
    assert r1_in.wait(WAIT)
    w, w_in, w_go = holder(lock, "write", log, "w")
    wait_until(waiting(lock, 1))  # the writer waits for the reader inside
    r2, r2_in, r2_go = holder(lock, "read", log, "r2")  # a reader that comes after the waiting writer
    w2, w2_in, w2_go = holder(lock, "write", log, "w2")
    wait_until(waiting(lock, 2))
    assert not w_in.is_set() and not r2_in.is_set() and not w2_in.is_set()
    r1_go.set()
    # one writer enters (which of the two is not ordered), alone: neither the other writer nor the reader
    writers = {"w": (w_in, w_go), "w2": (w2_in, w2_go)}
    wait_until(lambda: w_in.is_set() or w2_in.is_set())
    first = "w" if w_in.is_set() else "w2"
    second = "w2" if first == "w" else "w"
    assert not r2_in.wait(0.2) and not writers[second][0].is_set()
    writers[first][1].set()
    assert writers[second][0].wait(WAIT)  # writers first: the other writer before the reader waiting since earlier
    assert not r2_in.wait(0.2)
    writers[second][1].set()
    assert r2_in.wait(WAIT)
    r2_go.set()
    for t in (r1, w, r2, w2):
        t.join(WAIT)
        assert not t.is_alive()
    assert log == ["r1 in", "r1 out", f"{first} in", f"{first} out", f"{second} in", f"{second} out", "r2 in", "r2 out"]


@pytest.mark.parametrize("side", ["read", "write"])
def test_an_exception_inside_releases_the_lock(side: str) -> None:
    lock = ReadWriteLock()
    with pytest.raises(KeyError), lock.read() if side == "read" else lock.write():
        raise KeyError("inside")
    done = threading.Event()

    def write() -> None:
        with lock.write():
            done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(WAIT)  # nothing is left holding it
    with lock.read():
        pass
