"""Bounded HTTP load on a running service: p50/p99 per route, answers by status, server memory.

    python -m fragsearch.service &                                   # or ./run serve
    python -m bench.load_bench --url http://127.0.0.1:8000 --clients 8 --duration 60

Each scenario runs with each `--clients` count (concurrent clients, asyncio + httpx, one request
in flight each; `--clients 1 8` gives the unloaded latency and the loaded one) for `--duration`
seconds: "search" (POST /search/images), "annotate" (POST /annotate with a 224 px image, a different
file every request: the service keeps the regions of recent uploads, and the same bytes again would measure that),
"fragments" (POST /search/fragments) and "mixed" (70 % search, 20 % annotate, 10 % fragments).
A client refused with 503/504 waits the `Retry-After` it was given (at most to the end of the
scenario) before its next request, as a well-behaved client backs off. A separate probe asks
GET /healthz every `--probe-every` seconds on its own connection (its p50/p99 show whether the
service stays responsive). The server's resident memory is sampled every `--rss-every` seconds
(of process <pid> with `--pid`, else from its /metrics) into `--samples-out`. Rows go to
docs/results/service-load.csv (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import logging
import random
import shlex
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from PIL import Image
from spacy.lang.en.stop_words import STOP_WORDS

from bench import machine
from fragsearch.settings import default_data_dir

logger = logging.getLogger("bench.load_bench")

FIELDS = ("scenario", "route", "clients", "seconds", "requests", "errors", "statuses", "rps", "ok_rps", "p50_ms",
          "p90_ms", "p99_ms", "max_ms", "ok_p50_ms", "ok_p99_ms", "health_n", "health_p50_ms", "health_p99_ms",
          "health_max_ms", "rss_before_mb", "rss_after_mb", "rss_max_mb", "loadavg_1m", "machine", "command")
SAMPLE_FIELDS = ("scenario", "clients", "t_s", "rss_mb", "requests")
BACK_OFF = (503, 504)  # answers that ask the client to come back later (Retry-After)
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "service-load.csv"
SCENARIOS = ("search", "annotate", "fragments", "mixed")
MIX = (("search", 0.7), ("annotate", 0.2), ("fragments", 0.1))
UPLOAD_SIDE = 224
UPLOAD_VARIANTS = 1024  # distinct uploads sent in turn (the service keeps far fewer)
FALLBACK_SENTENCES = (
    "a dog runs through the grass", "two children play on the beach", "a man rides a bike down the street",
    "a black dog jumps over a log", "a woman in a red coat walks in the snow", "a group of people stand outside",
    "a brown dog swims in the water", "a boy in a blue shirt climbs a rock", "a girl throws a ball in the park",
    "a skier goes down a snowy hill",
)
FALLBACK_PHRASES = ("black dog", "red shirt", "green grass", "blue water", "white snow", "small child")



@dataclass
class Workload:
    """What the clients send: sentences, phrases and an upload (`variants` of it, distinct files of the same
    pixels, sent in turn so that no annotation is answered from the service's recent uploads)."""

    sentences: list[str]
    phrases: list[str]
    upload: bytes
    k: int = 10
    variants: list[bytes] = field(default_factory=list)
    sent: int = 0

    def next_upload(self) -> bytes:
        """The next variant of the upload (the upload itself when there are none)."""
        if not self.variants:
            return self.upload
        self.sent += 1
        return self.variants[(self.sent - 1) % len(self.variants)]


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ok_latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    statuses: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    samples: dict[str, str] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    def record(self, route: str, seconds: float, status: str, ok: bool, sample: str = "") -> None:
        self.latencies[route].append(seconds)
        self.statuses[route][status] += 1
        if ok:
            self.ok_latencies[route].append(seconds)
        else:
            self.errors[route] += 1
            self.samples.setdefault(route, sample)


def retry_after(resp: httpx.Response, default: float = 1.0) -> float:
    """Seconds a 503/504 asks the client to wait (its Retry-After header, else `default`)."""
    try:
        return max(0.0, float(resp.headers.get("retry-after", default)))
    except ValueError:
        return default


def phrases_of(sentences: Sequence[str], n: int = 50) -> list[str]:
    """Two-word phrases taken from the sentences (adjacent alphabetic words, neither a function word:
    "across the" has nothing to match and is refused with 422)."""
    pairs = {f"{a} {b}".lower() for text in sentences for a, b in zip(text.split(), text.split()[1:], strict=False)
             if a.isalpha() and b.isalpha() and a.lower() not in STOP_WORDS and b.lower() not in STOP_WORDS}
    return sorted(pairs)[:n] if pairs else list(FALLBACK_PHRASES)


def load_workload(data: Path, k: int) -> Workload:
    """Dev captions as queries (and two-word phrases from them), the first dev image re-encoded at
    224 px as the upload (built-in fallbacks without a data folder)."""
    sentences = list(FALLBACK_SENTENCES)
    upload_img: Image.Image | None = None
    captions, dev = data / "captions.txt", data / "dev.txt"
    if captions.is_file() and dev.is_file():
        names = {ln.strip() for ln in dev.read_text().splitlines() if ln.strip()}
        rows = [ln.split("\t", 1) for ln in captions.read_text().splitlines() if "\t" in ln]
        dev_caps = [cap.strip() for key, cap in rows if key.split("#")[0] in names and cap.strip()]
        if dev_caps:
            sentences = random.Random(0).sample(dev_caps, min(200, len(dev_caps)))
        first = sorted(names)[0] if names else None
        if first and (data / "images" / first).is_file():
            upload_img = Image.open(data / "images" / first).convert("RGB")
    if upload_img is None:
        rng = np.random.default_rng(0)
        upload_img = Image.fromarray(rng.integers(0, 255, (UPLOAD_SIDE, UPLOAD_SIDE, 3), dtype=np.uint8))
    upload_img = upload_img.resize((UPLOAD_SIDE, UPLOAD_SIDE))
    return Workload(sentences, phrases_of(sentences), jpeg_bytes(upload_img), k, upload_variants(upload_img))


def jpeg_bytes(image: Image.Image, comment: str = "") -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90, **({"comment": comment} if comment else {}))
    return buf.getvalue()


def upload_variants(image: Image.Image, n: int = UPLOAD_VARIANTS) -> list[bytes]:
    """`n` files of the picture, each with its own JPEG comment: the same pixels (the same work) in distinct
    files, as the same scene in two photos' files is."""
    return [jpeg_bytes(image, f"upload {i}") for i in range(n)]


async def one_request(client: httpx.AsyncClient, route: str, work: Workload, rng: random.Random) -> httpx.Response:
    if route == "search":
        return await client.post("/search/images", json={"sentence": rng.choice(work.sentences), "k": work.k})
    if route == "fragments":
        return await client.post("/search/fragments", json={"phrase": rng.choice(work.phrases), "k": work.k})
    files = {"file": ("upload.jpg", work.next_upload(), "image/jpeg")}
    return await client.post("/annotate", files=files, data={"k": str(min(work.k, 5))})


def pick(scenario: str, rng: random.Random, mix: Sequence[tuple[str, float]] = MIX) -> str:
    """The route of the next request: the scenario's own, or drawn from `mix` for "mixed"."""
    if scenario != "mixed":
        return scenario
    r, acc = rng.random(), 0.0
    for route, share in mix:
        acc += share
        if r < acc:
            return route
    return mix[0][0]


async def client_loop(client: httpx.AsyncClient, scenario: str, work: Workload, deadline: float, seed: int,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        route = pick(scenario, rng)
        t0 = time.perf_counter()
        try:
            resp = await one_request(client, route, work, rng)
        except httpx.HTTPError as e:
            tally.record(route, time.perf_counter() - t0, type(e).__name__, False, f"{type(e).__name__}: {e}")
            continue
        ok = resp.status_code == 200
        tally.record(route, time.perf_counter() - t0, str(resp.status_code), ok,
                     f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code in BACK_OFF:
            await asyncio.sleep(min(retry_after(resp), max(0.0, deadline - time.perf_counter())))


async def health_probe(url: str, every: float, stop: asyncio.Event, out: list[float]) -> None:
    """GET /healthz every `every` seconds on its own connection until `stop`; latencies (s) into `out`
    (a failed probe counts as its time to fail)."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as probe:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                (await probe.get("/healthz")).raise_for_status()
            except httpx.HTTPError as e:
                logger.warning("health probe failed: %s", e)
            out.append(time.perf_counter() - t0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=every)


def loadavg() -> float:
    """The machine's 1-minute load average (other jobs share the cores: the results say how busy it was)."""
    return float(psutil.getloadavg()[0])


def proc_rss_mb(pid: int) -> float:
    """Resident memory of process `pid`, NaN if unreadable."""
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return float("nan")


def proc_counts(pid: int) -> dict[str, int]:
    """Open file descriptors and threads of process `pid` (-1 where unreadable)."""
    try:
        proc = psutil.Process(pid)
        return {"fds": proc.num_fds(), "threads": proc.num_threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {"fds": -1, "threads": -1}


async def rss_sampler(read: Callable[[], Any], every: float, stop: asyncio.Event, t0: float,
                      requests: Callable[[], int], out: list[tuple[float, float, int]]) -> None:
    """(seconds since t0, RSS MB, requests so far) every `every` seconds until `stop`."""
    while True:
        rss = await read()
        out.append((round(time.perf_counter() - t0, 1), round(rss, 1), requests()))
        try:
            await asyncio.wait_for(stop.wait(), timeout=every)
            return
        except TimeoutError:
            pass


async def server_rss_mb(client: httpx.AsyncClient) -> float:
    """The server's resident memory from its /metrics (process_resident_memory_bytes), NaN if absent."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes"):
            return float(line.split()[-1]) / 2**20
    return float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else float("nan")


def tally_size(tally: Tally) -> Callable[[], int]:
    return lambda: tally.requests


def rss_reader(client: httpx.AsyncClient, pid: int | None) -> Callable[[], Any]:
    """An async function giving the server's RSS in MB: from the process with its pid, else from /metrics."""
    async def read() -> float:
        return proc_rss_mb(pid) if pid else await server_rss_mb(client)
    return read


async def run(url: str, scenarios: Sequence[str], client_counts: Sequence[int], duration: float, work: Workload,
              warmup: float, pid: int | None = None, rss_every: float = 5.0, probe_every: float = 0.25,
              samples: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    most = max(client_counts)
    limits = httpx.Limits(max_connections=most + 1, max_keepalive_connections=most + 1)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        read_rss = rss_reader(client, pid)
        ready = await client.get("/readyz")
        if ready.status_code != 200:
            raise SystemExit(f"{url} is not ready: HTTP {ready.status_code} {ready.text[:200]}")
        logger.info("server ready: %s", ready.json())
        if warmup > 0:
            await asyncio.gather(*(client_loop(client, "mixed", work, time.perf_counter() + warmup, 1000 + c,
                                               Tally()) for c in range(most)))
        rss_before = await read_rss()
        rows: list[dict[str, object]] = []
        for scenario, clients in ((s, c) for s in scenarios for c in client_counts):
            tally = Tally()
            health: list[float] = []
            rss: list[tuple[float, float, int]] = []
            stop = asyncio.Event()
            start = time.perf_counter()
            deadline = start + duration
            watchers = [asyncio.create_task(health_probe(url, probe_every, stop, health)),
                        asyncio.create_task(rss_sampler(read_rss, rss_every, stop, start, tally_size(tally), rss))]
            await asyncio.gather(*(client_loop(client, scenario, work, deadline, c, tally) for c in range(clients)))
            elapsed = time.perf_counter() - start
            stop.set()
            await asyncio.gather(*watchers)
            rss_now = await read_rss()
            if samples is not None:
                samples.extend({"scenario": scenario, "clients": clients, "t_s": t, "rss_mb": m, "requests": n}
                               for t, m, n in rss)
            for route, lat in sorted(tally.latencies.items()):
                ok = tally.ok_latencies[route]
                rows.append({
                    "scenario": scenario, "route": route, "clients": clients, "seconds": round(elapsed, 1),
                    "requests": len(lat), "errors": tally.errors[route],
                    "statuses": " ".join(f"{k}={v}" for k, v in sorted(tally.statuses[route].items())),
                    "rps": round(len(lat) / elapsed, 2), "ok_rps": round(len(ok) / elapsed, 2),
                    "p50_ms": round(percentile(lat, 50), 1), "p90_ms": round(percentile(lat, 90), 1),
                    "p99_ms": round(percentile(lat, 99), 1), "max_ms": round(max(lat) * 1000, 1),
                    "ok_p50_ms": round(percentile(ok, 50), 1), "ok_p99_ms": round(percentile(ok, 99), 1),
                    "health_n": len(health), "health_p50_ms": round(percentile(health, 50), 1),
                    "health_p99_ms": round(percentile(health, 99), 1),
                    "health_max_ms": round(max(health, default=float("nan")) * 1000, 1),
                    "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_now, 1),
                    "rss_max_mb": max((m for _, m, _ in rss), default=float("nan")), "loadavg_1m": loadavg(),
                })
                logger.info("%-9s %-9s clients=%d n=%-6d %s p50=%.1f ms p99=%.1f ms (%.1f req/s); /healthz p99 "
                            "%.1f ms", scenario, route, clients, len(lat), rows[-1]["statuses"], percentile(lat, 50),
                            percentile(lat, 99), len(lat) / elapsed, percentile(health, 99))
                if route in tally.samples:
                    logger.warning("first non-200 answer on %s: %s", route, tally.samples[route])
        logger.info("server RSS: %.0f MB before, %.0f MB after", rss_before, await read_rss())
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the running service's base URL (loopback only)")
    ap.add_argument("--clients", type=int, nargs="+", default=[8], help="client counts to run each scenario with")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per scenario (e.g. 10 for a quick run)")
    ap.add_argument("--scenarios", nargs="+", default=["search", "annotate", "mixed"], choices=SCENARIOS,
                    help="what each client sends")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of unrecorded load first")
    ap.add_argument("--k", type=int, default=10, help="results per query")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="queries: dev captions; upload: a dev image")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    ap.add_argument("--pid", type=int, help="the server's process id (RSS from the process instead of /metrics)")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between two RSS samples")
    ap.add_argument("--probe-every", type=float, default=0.25, help="seconds between two /healthz probes")
    ap.add_argument("--samples-out", type=Path, help="CSV of the RSS samples (scenario, clients, t_s, rss_mb)")
    ap.add_argument("--allow-refusals", action="store_true",
                    help="exit 0 when the only non-200 answers are 503/504 refusals (an overload run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if min(args.clients) < 1 or args.duration <= 0:
        ap.error("--clients and --duration must be positive")
    work = load_workload(args.data, args.k)
    samples: list[dict[str, object]] = []
    rows = asyncio.run(run(args.url, args.scenarios, args.clients, args.duration, work, args.warmup, args.pid,
                           args.rss_every, args.probe_every, samples))
    command = "python -m bench.load_bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    write_csv(args.out, FIELDS, [{**row, "machine": machine(), "command": command} for row in rows])
    if args.samples_out is not None:
        write_csv(args.samples_out, SAMPLE_FIELDS, samples)
    refused = {str(c) for c in BACK_OFF}
    failed = [r for r in rows for part in str(r["statuses"]).split()
              if part.split("=")[0] != "200" and not (args.allow_refusals and part.split("=")[0] in refused)]
    return 1 if failed else 0


def write_csv(path: Path, fields: Sequence[str], rows: Sequence[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    logger.info("wrote %s", path)


if __name__ == "__main__":
    sys.exit(main())
