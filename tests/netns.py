"""Test hosts in network namespaces made by the test (``ip netns`` + veth pairs, 10.231.x addresses that
exist inside the namespaces only), and Ray nodes started in them and stopped by PID.

Why namespaces: Ray 2.60 started on this host registers the host's own address and listens on every
interface even when asked for 127.0.0.1 (``--node-ip-address=127.0.0.1``; seen with ``ss -ltnp``). In a
namespace whose only link is loopback it resolves 127.0.0.1 and listens there only, and in a pair of
namespaces joined by a veth pair it talks over that pair: the tests' traffic stays in namespaces they made.
Needs CAP_SYS_ADMIN; `hosts` skips the test, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Host:
    ns: str
    ip: str  # 127.0.0.1 for a host of its own (loopback only)


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """n = 1: one namespace with loopback only; n = 2: two joined by a veth pair (10.231.k.1 / .2, k from
    this process id). Removed afterwards (the veth pair goes with them)."""
    if n not in (1, 2):
        raise ValueError("one or two hosts")
    tag = f"{os.getpid() % 100000}"
    net = f"10.231.{os.getpid() % 250 + 1}"
    made: list[Host] = []
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    try:
        for k in range(n):
            host = Host(f"fragsearch-{'ab'[k]}-{tag}", f"{net}.{k + 1}" if n == 2 else "127.0.0.1")
            done = ip("netns", "add", host.ns)
            if done.returncode != 0:
                pytest.skip(f"cannot make a network namespace here (needs CAP_SYS_ADMIN): {done.stderr.strip()}")
            made.append(host)
            check(ip("-n", host.ns, "link", "set", "lo", "up"))
        if n == 2:
            devs = (f"fsa{tag}", f"fsb{tag}")
            check(ip("link", "add", devs[0], "type", "veth", "peer", "name", devs[1]))
            for host, dev in zip(made, devs, strict=True):
                check(ip("link", "set", dev, "netns", host.ns))
                check(ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", dev))
                check(ip("-n", host.ns, "link", "set", dev, "up"))
                # a default route over the pair lets Ray find the host's address by itself; the peer
                # forwards nothing, so no packet leaves the two namespaces
                check(ip("-n", host.ns, "route", "add", "default", "dev", dev))
        yield made
    finally:
        for host in made:
            ip("netns", "del", host.ns)


def check(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{' '.join(map(str, done.args))}: {done.stderr}"


def in_ns(host: Host, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", host.ns, *cmd]


RAY_TOKEN = secrets.token_hex(32)  # the test clusters' authentication token (Ray 2.60 asks for one)


def ray_env(temp: str) -> dict[str, str]:
    """The environment of Ray processes and drivers in the tests: this checkout importable, no usage
    reports, Ray's session files under ``temp`` (how `stop_ray` finds the processes to end), token
    authentication with a token of this test session (head, workers and driver share it; the user's
    ~/.ray/auth_token is neither read nor written)."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO), "RAY_TMPDIR": temp,
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_TOKEN}


def ray_temp() -> str:
    """A short folder for a Ray node's session files (its unix sockets: a path has at most 107 chars)."""
    return tempfile.mkdtemp(prefix="fsray", dir="/tmp")


def stop_ray(procs: list[subprocess.Popen[bytes]], temps: list[str]) -> None:
    """End `procs` (by process group), then any process still running with one of ``temps`` on its
    command line (Ray's daemons name their session folder): by PID, never by name; remove ``temps``."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for running in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(running.info["cmdline"] or [])
        if running.info["pid"] != os.getpid() and any(t in cmdline for t in temps):
            with contextlib.suppress(psutil.NoSuchProcess):
                running.kill()
    for t in temps:
        shutil.rmtree(t, ignore_errors=True)
