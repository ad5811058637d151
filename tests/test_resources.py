"""CPUs and memory a process may use, read from cgroup trees (v1 and v2) laid out in a temp folder the
way the kernel shows them, and the default number of extraction workers they give."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fragsearch.model.resources import available_memory, cpu_quota, default_workers, memory_limit, usable_cpus
from fragsearch.settings import Settings

GIB = 1 << 30
AFFINITY = len(os.sched_getaffinity(0))


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def _v2(tmp_path: Path, own: dict[str, str], parent: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A unified hierarchy: the process in /app/job, `own` its limit files, `parent` /app's."""
    root = tmp_path / "cgroup"
    _files(root, {"cgroup.controllers": "cpu memory", **{f"app/job/{k}": v for k, v in own.items()},
                  **{f"app/{k}": v for k, v in (parent or {}).items()}})
    _files(tmp_path, {"self-cgroup": "0::/app/job"})
    return root, tmp_path / "self-cgroup"


def test_cgroup_v2_quota_and_limit_are_read_with_the_tightest_parent(tmp_path: Path) -> None:
    root, proc = _v2(tmp_path, {"cpu.max": "max 100000", "memory.max": "max"},
                     {"cpu.max": "150000 100000", "memory.max": str(3 * GIB)})
    assert cpu_quota(root, proc) == 1.5
    assert memory_limit(root, proc) == 3 * GIB
    assert usable_cpus(root, proc) == min(AFFINITY, 2)  # 1.5 CPUs' time: two processes can use it


def test_cgroup_v2_without_limits_is_the_affinity_mask(tmp_path: Path) -> None:
    root, proc = _v2(tmp_path, {"cpu.max": "max 100000", "memory.max": "max"})
    assert cpu_quota(root, proc) is None and memory_limit(root, proc) is None
    assert usable_cpus(root, proc) == AFFINITY


def test_cgroup_v1_quota_and_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _files(root, {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us":
                  "100000", "memory/docker/abc/memory.limit_in_bytes": str(2 * GIB),
                  "memory/memory.limit_in_bytes": "9223372036854771712"})  # the root: no limit
    _files(tmp_path, {"self-cgroup": "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/"})
    proc = tmp_path / "self-cgroup"
    assert cpu_quota(root, proc) == 0.5
    assert usable_cpus(root, proc) == 1
    assert memory_limit(root, proc) == 2 * GIB


def test_workers_default_to_the_cpus_that_fit_in_memory(tmp_path: Path) -> None:
    root, proc = _v2(tmp_path, {"cpu.max": "max 100000", "memory.max": "max"})
    _files(tmp_path, {"meminfo": "MemTotal:       65000000 kB\nMemAvailable:   64000000 kB"})
    meminfo = tmp_path / "meminfo"
    assert available_memory(root, proc, meminfo) == 64000000 * 1024
    assert default_workers(root, proc, meminfo) == AFFINITY
    assert default_workers(root, proc, meminfo, per_worker=64000000 * 1024) == 1  # room for one only
    (root / "app" / "job" / "memory.max").write_text(f"{GIB // 2}\n")  # less than one worker's share
    assert available_memory(root, proc, meminfo) == GIB // 2
    assert default_workers(root, proc, meminfo) == 1


def test_no_cgroup_file_means_no_limit(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path, tmp_path / "absent") is None
    assert memory_limit(tmp_path, tmp_path / "absent") is None
    assert usable_cpus(tmp_path, tmp_path / "absent") == AFFINITY


def test_service_workers_default_to_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRAGSEARCH_WORKERS", "")  # what compose passes when it is not set
    assert Settings().workers is None
    assert Settings().worker_count == default_workers()
    monkeypatch.setenv("FRAGSEARCH_WORKERS", "3")
    assert Settings().worker_count == 3
