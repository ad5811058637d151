"""Two hosts, one bulk extraction: a Ray head and a Ray worker node in two network namespaces made here
(tests/netns.py), the driver (``python -m fragsearch.index.bulk --engine ray --address``) beside the head. Marked
slow: two Ray nodes start. Skipped, with the reason, where network namespaces cannot be made.

The head offers 1 CPU and the worker 2; the job asks for 2 backbone actors (1 CPU each) and a CPU for
the proposal stage, so it cannot finish without both hosts. The shards must hold the plain extractor's
features.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fragsearch.model.image import RegionExtractor
from tests.netns import REPO, hosts, in_ns, ray_env, ray_temp, stop_ray
from tests.test_bulk import RAY_CFG, RAY_FLAGS, check_shards_equal_plain, photo_folder

pytestmark = pytest.mark.slow

GCS_PORT = 8150  # the head's port, inside namespace A
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 600


def listening(ns: str, addr: str) -> bool:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltn"], capture_output=True, text=True, timeout=30)
    anywhere = f"*:{addr.rsplit(':', 1)[1]}"
    return any(addr in line.split() or anywhere in line.split() for line in out.stdout.splitlines())


def test_a_ray_head_and_a_worker_on_two_hosts_extract_one_folder(tmp_path: Path):
    photos = photo_folder(tmp_path)
    shards = tmp_path / "shards"
    ray_bin = str(Path(sys.executable).with_name("ray"))
    temps = [ray_temp(), ray_temp()]
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / "ray-head.log", tmp_path / "ray-worker.log"]
    try:
        with hosts(2) as (a, b):
            head = f"{a.ip}:{GCS_PORT}"
            with logs[0].open("wb") as log:
                procs.append(subprocess.Popen(
                    in_ns(a, ray_bin, "start", "--head", "--block", f"--node-ip-address={a.ip}", f"--port={GCS_PORT}",
                          "--num-cpus=1", "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temps[0]}",
                          "--disable-usage-stats"),
                    env=ray_env(temps[0]), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + START_TIMEOUT_S
            while not listening(a.ns, head):
                assert procs[0].poll() is None, logs[0].read_text()
                assert time.monotonic() < deadline, "the Ray head did not start"
                time.sleep(1)
            with logs[1].open("wb") as log:
                procs.append(subprocess.Popen(
                    in_ns(b, ray_bin, "start", "--block", f"--address={head}", f"--node-ip-address={b.ip}",
                          "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temps[1]}", "--disable-usage-stats"),
                    env=ray_env(temps[1]), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            job = subprocess.run(
                in_ns(a, sys.executable, "-m", "fragsearch.index.bulk", "--engine", "ray", "--address", head,
                      "--workers", "2",
                      "--images", str(photos), "--shards", str(shards), "--no-cache", "--batch", "2",
                      "--shard-size", "4", "--model", str(tmp_path / "no-model.pt"), *RAY_FLAGS),
                env=ray_env(temps[0]), cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
            assert job.returncode == 0, job.stderr[-4000:]
            # the second host ran Ray workers of its own: their logs are in its session folder
            assert list(Path(temps[1]).rglob("python-core-worker-*.log")), logs[1].read_text()[-2000:]
    finally:
        stop_ray(procs, temps)
    check_shards_equal_plain(shards, photos, RegionExtractor(RAY_CFG))
