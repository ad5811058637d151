"""What this process may use of the machine: CPUs and memory, as a container limits them; and what the
CPU is (`cpu_info`: its name, clock and instruction sets, which the benchmarks and a release record).

`os.cpu_count()` is the host's count; in a container (`docker run --cpus`, a compose `cpus:` limit,
Kubernetes) the CPU quota and the memory limit live in the process's cgroup, and the CPU affinity
(`--cpuset-cpus`) in its scheduler mask. Both cgroup versions are read: v2 (`cpu.max`, `memory.max`)
and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.limit_in_bytes`), along the process's
cgroup path up to the hierarchy's root, the tightest limit winning.

`default_workers()` is how many feature-extraction processes the preparation starts when none is
configured: one per usable CPU, as many as fit in the memory at hand (a worker holds its own
backbone and ONNX session: ~0.9 GB resident, 0.5 GB of it private, measured on the `full` variant).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
CPUINFO = Path("/proc/cpuinfo")
WORKER_MEMORY = 1 << 30  # bytes budgeted per extraction worker
_UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def _cgroup_dirs(controller: str, root: Path, proc_cgroup: Path) -> list[Path]:
    """The folders holding `controller`'s limits for this process, its own cgroup first, then its
    parents up to the hierarchy's root (a parent's limit applies too); [] when there is none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, names, path = line.split(":", 2)
        if names and controller in names.split(","):  # v1: a hierarchy per controller (or a pair)
            base = root / names if (root / names).is_dir() else root / controller
            break
        if names == "" and (root / "cgroup.controllers").is_file():  # v2: one unified hierarchy
            base = root
            break
    else:
        return []
    folder = base / path.lstrip("/")
    out = []
    while True:
        if folder.is_dir():
            out.append(folder)
        if folder == base or base not in folder.parents:
            return out
        folder = folder.parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The cgroup CPU quota in CPUs (1.5 = one and a half CPUs' time), None when unlimited."""
    limits = []
    for folder in _cgroup_dirs("cpu", root, proc_cgroup):
        v2 = _read(folder / "cpu.max")  # "<quota> <period>" or "max <period>"
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
            continue
        quota_us, period_us = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota_us and period_us and int(quota_us) > 0:
            limits.append(int(quota_us) / int(period_us))
    return min(limits, default=None)


def memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The cgroup memory limit in bytes, None when unlimited."""
    limits = []
    for folder in _cgroup_dirs("memory", root, proc_cgroup):
        value = _read(folder / "memory.max")
        if value is None:
            value = _read(folder / "memory.limit_in_bytes")
        if value and value != "max" and int(value) < _UNLIMITED_V1:
            limits.append(int(value))
    return min(limits, default=None)


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs this process may run on (its affinity mask), capped by the cgroup quota rounded up."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota(root, proc_cgroup)
    return max(1, min(cpus, math.ceil(quota)) if quota is not None else cpus)


def available_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP,
                     meminfo: Path = MEMINFO) -> int | None:
    """Bytes of memory at hand: the machine's MemAvailable, capped by the cgroup limit (None if unknown)."""
    found = []
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append(int(line.split()[1]) * 1024)
    limit = memory_limit(root, proc_cgroup)
    if limit is not None:
        found.append(limit)
    return min(found, default=None)


def default_workers(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP, meminfo: Path = MEMINFO,
                    per_worker: int = WORKER_MEMORY) -> int:
    """Extraction processes to start: one per usable CPU, no more than `per_worker` bytes each fit."""
    cpus = usable_cpus(root, proc_cgroup)
    memory = available_memory(root, proc_cgroup, meminfo)
    return cpus if memory is None else max(1, min(cpus, memory // per_worker))


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "unknown" where /proc/cpuinfo does not say
    flags: frozenset[str]  # the instruction sets the first CPU announces
    mhz: float  # its reported clock, nan when unknown


def cpu_info(path: Path = CPUINFO) -> CpuInfo:
    """The CPU's name, flags and clock from /proc/cpuinfo (Linux; psutil does not name the CPU), from its
    first processor's lines."""
    model, flags, mhz = "unknown", frozenset[str](), math.nan
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return CpuInfo(model, flags, mhz)
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "cpu MHz" and math.isnan(mhz):
            mhz = float(value)
    return CpuInfo(model, flags, mhz)


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
              "avx512_bf16", "amx_int8")


def cpu_record() -> dict[str, Any]:
    """The CPU's model name and the SIMD flags that choose ONNX Runtime's kernels."""
    cpu = cpu_info()
    return {"model": cpu.model, "flags": [f for f in SIMD_FLAGS if f in cpu.flags]}
