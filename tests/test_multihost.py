"""Two hosts, one bulk extraction: a Ray head and a Ray worker node in two network namespaces made here
(``ip netns`` + a veth pair, 10.231.x addresses that exist inside the namespaces only), the driver
(``python -m index.bulk --engine ray --address``) beside the head. Nothing leaves the namespaces: each
one's only link is the other. Needs CAP_SYS_ADMIN (root in a container usually has it); skipped with
the reason where namespaces cannot be made. Marked slow: two Ray nodes start (~20 s).

The head offers 1 CPU and the worker 2; the job asks for 2 backbone actors + a CPU for the proposal
stage, so it cannot finish without both hosts. The shards must hold the plain extractor's features.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from index import list_images
from index.shards import read_failed, read_shard, shard_files
from model.config import ImageConfig
from model.image import RegionExtractor
from model.imageio import load_image
from tests.test_bulk import photo_folder

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
GCS_PORT = 8150  # the head's port, inside namespace A
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 600
# the served model's image settings, as region flags
FLAGS = ["--region-features", "crop", "--backbone-precision", "int8", "--proposal-resize", "112",
         "--backbone-size", "224", "--min-box-frac", "0.25"]
CFG = ImageConfig(region_features="crop", backbone_precision="int8", proposal_resize=112, backbone_size=224,
                  min_box_frac=0.25)


@dataclass
class Host:
    ns: str
    ip: str


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B joined by a veth pair (10.231.n.1 / .2, n from this process id); removed after."""
    tag = f"{os.getpid() % 100000}"
    net = f"10.231.{os.getpid() % 250 + 1}"
    a, b = Host(f"fragsearch-a-{tag}", f"{net}.1"), Host(f"fragsearch-b-{tag}", f"{net}.2")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    made = ip("netns", "add", a.ns)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (needs CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        steps = [("netns", "add", b.ns), ("link", "add", f"fsa{tag}", "type", "veth", "peer", "name", f"fsb{tag}")]
        for host, dev in ((a, f"fsa{tag}"), (b, f"fsb{tag}")):
            steps += [("link", "set", dev, "netns", host.ns),
                      ("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", dev),
                      ("-n", host.ns, "link", "set", dev, "up"),
                      ("-n", host.ns, "link", "set", "lo", "up"),
                      # a default route over the pair, so Ray finds each host's address by itself; the
                      # peer forwards nothing, so no packet leaves the two namespaces
                      ("-n", host.ns, "route", "add", "default", "dev", dev)]
        for step in steps:
            done = ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield a, b
    finally:
        for host in (a, b):
            ip("netns", "del", host.ns)  # the veth pair goes with its namespaces


def in_ns(host: Host, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", host.ns, *cmd]


def ray_env() -> dict[str, str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}
    return env


def listening(host: Host, port: int) -> bool:
    out = subprocess.run(in_ns(host, "ss", "-ltn"), capture_output=True, text=True, timeout=30).stdout
    return f"{host.ip}:{port} " in out or f"*:{port} " in out or f"0.0.0.0:{port} " in out


def stop(procs: list[subprocess.Popen[bytes]], marks: list[str]) -> None:
    """End the `ray start --block` processes (their process groups), then any Ray process still running
    with one of our temp folders on its command line: by PID, never by name."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(m in cmdline for m in marks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_dir.name), signal.SIGKILL)


def test_a_ray_head_and_a_worker_on_two_hosts_extract_one_folder(tmp_path: Path):
    photos = photo_folder(tmp_path)
    shards = tmp_path / "shards"
    ray_bin = str(Path(sys.executable).with_name("ray"))
    # short folders: Ray's unix sockets live under them (a socket path has at most 107 characters)
    temps = [tempfile.mkdtemp(prefix="fsray", dir="/tmp") for _ in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    logs = [open(tmp_path / f"ray-{k}.log", "wb") for k in range(2)]  # noqa: SIM115
    try:
        with two_hosts() as (a, b):
            head = f"{a.ip}:{GCS_PORT}"
            procs.append(subprocess.Popen(
                in_ns(a, ray_bin, "start", "--head", "--block", f"--node-ip-address={a.ip}", f"--port={GCS_PORT}",
                      "--num-cpus=1", "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temps[0]}",
                      "--disable-usage-stats"),
                env=ray_env(), stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + START_TIMEOUT_S
            while not listening(a, GCS_PORT):
                assert procs[0].poll() is None, (tmp_path / "ray-0.log").read_text()
                assert time.monotonic() < deadline, "the Ray head did not start"
                time.sleep(1)
            procs.append(subprocess.Popen(
                in_ns(b, ray_bin, "start", "--block", f"--address={head}", f"--node-ip-address={b.ip}",
                      "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temps[1]}", "--disable-usage-stats"),
                env=ray_env(), stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True))
            job = subprocess.run(
                in_ns(a, sys.executable, "-m", "index.bulk", "--engine", "ray", "--address", head, "--workers", "2",
                      "--images", str(photos), "--shards", str(shards), "--no-cache", "--batch", "2",
                      "--shard-size", "4", "--model", str(tmp_path / "no-model.pt"), *FLAGS),
                env=ray_env(), cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
            assert job.returncode == 0, job.stderr[-4000:]
            # the worker host ran Ray workers of its own (their logs are in its temp folder)
            worker_logs = list(Path(temps[1]).rglob("python-core-worker-*.log"))
            assert worker_logs, "no Ray worker process ran on the second host"
    finally:
        stop(procs, temps)
        for fh in logs:
            fh.close()
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
    extractor = RegionExtractor(CFG)
    rows = {p: (s, k) for f in shard_files(shards) for s in [read_shard(f)] for k, p in enumerate(s.paths)}
    assert sorted(rows) == sorted(str(p.resolve()) for p in list_images(photos) if p.name != "broken.jpg")
    assert list(read_failed(shards)) == ["broken.jpg"]
    for p, (shard, k) in rows.items():
        want = extractor.extract(load_image(Path(p).read_bytes(), name=p))
        np.testing.assert_array_equal(shard.boxes[k], want.boxes)
        np.testing.assert_array_equal(shard.features[k], want.features.astype(np.float16))
