"""A Milvus standalone server (the `milvus` package: Milvus 2.3.5) on this machine, in a network namespace
of its own.

The server listens on every interface it sees (its gRPC ports and the 9091 health port; only its
embedded etcd stays on 127.0.0.1), so it is only ever started in a network namespace whose one link is
loopback: the server and the clients that talk to it run there, and nothing they send reaches a real
interface. `own_namespace(argv)` is the command line that runs argv in a new one (with a user
namespace that maps the caller to root: no privilege needed where user namespaces are allowed);
inside, `loopback_up()` brings loopback up and `isolated()` says that it is the only link.
`LocalServer.start` refuses to run anywhere else.

    with LocalServer(folder) as server:          # healthy within START_TIMEOUT, else TimeoutError
        MilvusClient(uri=server.uri)
    server.kill(); server.start()                # SIGKILL, then the same data folder again

Used by the Milvus-server tests (tests/test_milvus_server.py) and bench/milvus_server.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

logger = logging.getLogger(__name__)

PORT = 19530  # the server's gRPC port inside its namespace
START_TIMEOUT = 120.0  # seconds for the health check to answer OK
STOP_GRACE = 5.0  # seconds a SIGTERM is given before SIGKILL (a 2.3.5 server may never finish one)
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: the name, the flags, the rest of the union (40 bytes)


def links() -> list[str]:
    """The network links of this process's network namespace."""
    return sorted(name for _, name in socket.if_nameindex())


def isolated() -> bool:
    """Whether this process runs in a network namespace whose only link is loopback."""
    return links() == ["lo"]


def loopback_up() -> None:
    """Bring the loopback link up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def own_namespace(argv: list[str]) -> list[str]:
    """The command line that runs `argv` in a new network namespace (and a user namespace mapping the
    caller to root, which lets an unprivileged user make it)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("no `unshare` command (util-linux): cannot make a network namespace")
    return [unshare, "--net", "--map-root-user", "--", *argv]


def namespaces_work() -> str | None:
    """None where `own_namespace` works on this machine, else why not."""
    try:
        done = subprocess.run(own_namespace(["true"]), capture_output=True, text=True, timeout=30)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else f"unshare --net --map-root-user: {done.stderr.strip()}"


def _config_type() -> type[Any]:
    from milvus import MilvusServerConfig

    class Config(MilvusServerConfig):  # type: ignore[misc]
        """The package's configuration, whose port check allows ports a killed server left in
        TIME_WAIT (the server itself binds them so)."""

        def try_bind_port(self, port: int) -> socket.socket | None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen()
                return sock
            except OSError:
                sock.close()
                return None

    return Config


class LocalServer:
    """A Milvus 2.3.5 standalone server on the data folder `data`, gRPC on 127.0.0.1:`port` of this
    process's network namespace; started, killed and started again on the same folder."""

    def __init__(self, data: Path, port: int = PORT) -> None:
        self.data = Path(data)
        self.port = port
        self._server: Any = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._server is None or self._server.server_proc is None:
            raise RuntimeError("the Milvus server is not running")
        return int(self._server.server_proc.pid)

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.server_proc is not None \
            and self._server.server_proc.poll() is None

    def logs(self, chars: int = 3000) -> str:
        """The end of the server's own log files (for an error message)."""
        out = []
        for name in ("milvus-stdout.log", "milvus-stderr.log"):
            with contextlib.suppress(OSError):
                out.append(f"{name}: {(self.data / 'logs' / name).read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def start(self, timeout: float = START_TIMEOUT) -> float:
        """Start the server and wait until its health check answers OK; returns the seconds it took.
        RuntimeError outside an isolated network namespace; TimeoutError (the server killed) when it
        is not healthy within `timeout`."""
        from milvus import MilvusServer

        if not isolated():
            raise RuntimeError(f"refusing to start a Milvus server outside a network namespace of its own "
                               f"(links here: {', '.join(links())}): it would listen on every one")
        if self.running:
            raise RuntimeError("the Milvus server is already running")
        began = time.monotonic()
        self.data.mkdir(parents=True, exist_ok=True)
        self._server = MilvusServer(_config_type()(data_dir=str(self.data)), wait_for_started=False,
                                    proxy_port=self.port)
        self._server.start()
        health = f"http://127.0.0.1:{self._server.webservice_port}/healthz"
        while time.monotonic() - began < timeout:
            if not self.running:
                self._forget()
                raise RuntimeError(f"the Milvus server exited while starting:\n{self.logs()}")
            with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(health, timeout=5) as r:
                if b"OK" in r.read():
                    took = time.monotonic() - began
                    logger.info("Milvus server (pid %d) healthy after %.1f s on %s", self.pid, took, self.uri)
                    return took
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"the Milvus server was not healthy within {timeout:.0f} s:\n{self.logs()}")

    def kill(self) -> None:
        """SIGKILL the server and every process it started (its embedded etcd must let go of its ports
        before the next start), and wait for them."""
        if self._server is not None and self._server.server_proc is not None:
            proc = self._server.server_proc
            family: list[psutil.Process] = []
            with contextlib.suppress(psutil.NoSuchProcess):
                family = psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            for child in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.wait(timeout=30)
            psutil.wait_procs(family, timeout=30)
        self._forget()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_GRACE seconds."""
        if self._server is not None and self._server.server_proc is not None:
            proc = self._server.server_proc
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        self._forget()

    def _forget(self) -> None:
        if self._server is not None:
            self._server.server_proc = None
            self._server.stop()  # closes its log files
            self._server = None

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
