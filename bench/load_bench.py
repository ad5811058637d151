"""Bounded HTTP load on a running service: p50/p99 per route, errors, server memory before/after.

    python -m service &                                   # or ./run serve
    python -m bench.load_bench --url http://127.0.0.1:8000 --clients 8 --duration 60

Each scenario runs with each `--clients` count (concurrent clients, asyncio + httpx, one request
in flight each; `--clients 1 8` gives the unloaded latency and the loaded one) for `--duration`
seconds: "search" (POST /search/images), "annotate" (POST /annotate with a 224 px image),
"fragments" (POST /search/fragments) and "mixed" (70 % search, 20 % annotate, 10 % fragments).
The server's resident memory is read from its /metrics before the first and
after the last scenario. Rows go to docs/results/service-load.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import logging
import random
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from bench import machine
from model.config import default_data_dir

logger = logging.getLogger("bench.load_bench")

FIELDS = ("scenario", "route", "clients", "seconds", "requests", "errors", "rps", "p50_ms", "p90_ms", "p99_ms",
          "max_ms", "rss_before_mb", "rss_after_mb", "machine", "command")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "service-load.csv"
SCENARIOS = ("search", "annotate", "fragments", "mixed")
MIX = (("search", 0.7), ("annotate", 0.2), ("fragments", 0.1))
UPLOAD_SIDE = 224
FALLBACK_SENTENCES = (
    "a dog runs through the grass", "two children play on the beach", "a man rides a bike down the street",
    "a black dog jumps over a log", "a woman in a red coat walks in the snow", "a group of people stand outside",
    "a brown dog swims in the water", "a boy in a blue shirt climbs a rock", "a girl throws a ball in the park",
    "a skier goes down a snowy hill",
)
FALLBACK_PHRASES = ("black dog", "red shirt", "green grass", "blue water", "white snow", "small child")



@dataclass
class Workload:
    """What the clients send: sentences, phrases and one upload."""

    sentences: list[str]
    phrases: list[str]
    upload: bytes
    k: int = 10


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    samples: dict[str, str] = field(default_factory=dict)


def phrases_of(sentences: Sequence[str], n: int = 50) -> list[str]:
    """Two-word phrases taken from the sentences (adjacent alphabetic words)."""
    pairs = {f"{a} {b}".lower() for text in sentences for a, b in zip(text.split(), text.split()[1:], strict=False)
             if a.isalpha() and b.isalpha() and a.lower() not in ("a", "an", "the")}
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
    buf = io.BytesIO()
    upload_img.save(buf, "JPEG", quality=90)
    return Workload(sentences, phrases_of(sentences), buf.getvalue(), k)


async def one_request(client: httpx.AsyncClient, route: str, work: Workload, rng: random.Random) -> httpx.Response:
    if route == "search":
        return await client.post("/search/images", json={"sentence": rng.choice(work.sentences), "k": work.k})
    if route == "fragments":
        return await client.post("/search/fragments", json={"phrase": rng.choice(work.phrases), "k": work.k})
    files = {"file": ("upload.jpg", work.upload, "image/jpeg")}
    return await client.post("/annotate", files=files, data={"k": str(min(work.k, 5))})


def pick(scenario: str, rng: random.Random) -> str:
    if scenario != "mixed":
        return scenario
    r, acc = rng.random(), 0.0
    for route, share in MIX:
        acc += share
        if r < acc:
            return route
    return MIX[0][0]


async def client_loop(client: httpx.AsyncClient, scenario: str, work: Workload, deadline: float, seed: int,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        route = pick(scenario, rng)
        t0 = time.perf_counter()
        try:
            resp = await one_request(client, route, work, rng)
            ok = resp.status_code == 200
            if not ok:
                tally.samples.setdefault(route, f"HTTP {resp.status_code}: {resp.text[:200]}")
        except httpx.HTTPError as e:
            ok = False
            tally.samples.setdefault(route, f"{type(e).__name__}: {e}")
        tally.latencies[route].append(time.perf_counter() - t0)
        if not ok:
            tally.errors[route] += 1


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


async def run(url: str, scenarios: Sequence[str], client_counts: Sequence[int], duration: float, work: Workload,
              warmup: float) -> list[dict[str, object]]:
    most = max(client_counts)
    limits = httpx.Limits(max_connections=most + 1, max_keepalive_connections=most + 1)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        ready = await client.get("/readyz")
        if ready.status_code != 200:
            raise SystemExit(f"{url} is not ready: HTTP {ready.status_code} {ready.text[:200]}")
        logger.info("server ready: %s", ready.json())
        if warmup > 0:
            await asyncio.gather(*(client_loop(client, "mixed", work, time.perf_counter() + warmup, 1000 + c,
                                               Tally()) for c in range(most)))
        rss_before = await server_rss_mb(client)
        rows: list[dict[str, object]] = []
        for scenario, clients in ((s, c) for s in scenarios for c in client_counts):
            tally = Tally()
            start = time.perf_counter()
            deadline = start + duration
            await asyncio.gather(*(client_loop(client, scenario, work, deadline, c, tally) for c in range(clients)))
            elapsed = time.perf_counter() - start
            rss_now = await server_rss_mb(client)
            for route, lat in sorted(tally.latencies.items()):
                rows.append({
                    "scenario": scenario, "route": route, "clients": clients, "seconds": round(elapsed, 1),
                    "requests": len(lat), "errors": tally.errors[route], "rps": round(len(lat) / elapsed, 2),
                    "p50_ms": round(percentile(lat, 50), 1), "p90_ms": round(percentile(lat, 90), 1),
                    "p99_ms": round(percentile(lat, 99), 1), "max_ms": round(max(lat) * 1000, 1),
                    "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_now, 1),
                })
                logger.info("%-9s %-9s clients=%d n=%-6d errors=%d p50=%.1f ms p99=%.1f ms (%.1f req/s)", scenario,
                            route, clients, len(lat), tally.errors[route], percentile(lat, 50), percentile(lat, 99),
                            len(lat) / elapsed)
                if route in tally.samples:
                    logger.warning("first error on %s: %s", route, tally.samples[route])
        logger.info("server RSS: %.0f MB before, %.0f MB after", rss_before, await server_rss_mb(client))
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, nargs="+", default=[8], help="client counts to run each scenario with")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per scenario (e.g. 10 for a quick run)")
    ap.add_argument("--scenarios", nargs="+", default=["search", "annotate", "mixed"], choices=SCENARIOS)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of unrecorded load first")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="queries: dev captions; upload: a dev image")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if min(args.clients) < 1 or args.duration <= 0:
        ap.error("--clients and --duration must be positive")
    work = load_workload(args.data, args.k)
    rows = asyncio.run(run(args.url, args.scenarios, args.clients, args.duration, work, args.warmup))
    command = "python -m bench.load_bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow({**row, "machine": machine(), "command": command})
    logger.info("wrote %s", args.out)
    return 1 if any(int(str(r["errors"])) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
