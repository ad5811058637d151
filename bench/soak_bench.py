"""A long run of mixed traffic against a running service: does its memory level off?

    FRAGSEARCH_API_KEY=... python -m fragsearch.service &
    python -m bench.soak_bench --url http://127.0.0.1:8000 --pid <server pid> --duration 600 --clients 4

`--clients` clients (one request in flight each) send, for `--duration` seconds, a mix of
POST /search/images, POST /search/fragments, POST /annotate and writes (POST /images of an
upload followed by DELETE of the image it made, so the index ends as it began). The server's
resident memory is sampled every `--rss-every` seconds with the number of requests answered so
far; after the warm-up (`--warmup-share` of the run) a straight line is fitted to RSS against
requests: its slope, MB per 1,000 requests, says whether memory levels off. Open file descriptors
and threads of the server are counted at the start and at the end. A probe asks GET /healthz
every `--probe-every` seconds. Writes docs/results/soak.json (summary) and soak-rss.csv (samples).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench import machine
from bench.load_bench import (
    BACK_OFF,
    SAMPLE_FIELDS,
    Tally,
    Workload,
    health_probe,
    load_workload,
    loadavg,
    one_request,
    percentile,
    pick,
    proc_counts,
    proc_rss_mb,
    retry_after,
    rss_sampler,
    tally_size,
    write_csv,
)
from fragsearch.settings import default_data_dir, from_environment

logger = logging.getLogger("bench.soak_bench")

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
MIX = (("search", 0.55), ("fragments", 0.15), ("annotate", 0.15), ("write", 0.15))


async def write_pair(client: httpx.AsyncClient, work: Workload, key: str, tally: Tally) -> httpx.Response | None:
    """POST /images, then DELETE the image it made; both recorded. Returns a refusal to back off on."""
    headers = {"X-API-Key": key}
    t0 = time.perf_counter()
    try:
        added = await client.post("/images", files={"file": ("soak.jpg", work.upload, "image/jpeg")},
                                  headers=headers)
    except httpx.HTTPError as e:
        tally.record("add", time.perf_counter() - t0, type(e).__name__, False, str(e))
        return None
    tally.record("add", time.perf_counter() - t0, str(added.status_code), added.status_code == 201,
                 f"HTTP {added.status_code}: {added.text[:200]}")
    if added.status_code != 201:
        return added
    t0 = time.perf_counter()
    try:
        gone = await client.delete(f"/images/{added.json()['id']}", headers=headers)
    except httpx.HTTPError as e:
        tally.record("delete", time.perf_counter() - t0, type(e).__name__, False, str(e))
        return None
    tally.record("delete", time.perf_counter() - t0, str(gone.status_code), gone.status_code == 204,
                 f"HTTP {gone.status_code}: {gone.text[:200]}")
    return gone


async def soak_client(client: httpx.AsyncClient, work: Workload, key: str, deadline: float, seed: int,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        route = pick("mixed", rng, MIX)
        resp: httpx.Response | None
        if route == "write":
            resp = await write_pair(client, work, key, tally)
        else:
            t0 = time.perf_counter()
            try:
                resp = await one_request(client, route, work, rng)
            except httpx.HTTPError as e:
                tally.record(route, time.perf_counter() - t0, type(e).__name__, False, str(e))
                continue
            tally.record(route, time.perf_counter() - t0, str(resp.status_code), resp.status_code == 200,
                         f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp is not None and resp.status_code in BACK_OFF:
            await asyncio.sleep(min(retry_after(resp), max(0.0, deadline - time.perf_counter())))


def slope_per_1000(samples: list[tuple[float, float, int]], after_s: float) -> tuple[float, float, int]:
    """Least-squares slope of RSS (MB) against requests (per 1,000) over the samples after `after_s`,
    and the RSS change between the first and last of them; (nan, nan, n) with fewer than 3."""
    late = [(n, m) for t, m, n in samples if t >= after_s and np.isfinite(m)]
    if len(late) < 3:
        return float("nan"), float("nan"), len(late)
    n, m = np.asarray(late, dtype=float).T
    slope = float(np.polyfit(n / 1000.0, m, 1)[0]) if np.ptp(n) > 0 else float("nan")
    return slope, float(m[-1] - m[0]), len(late)


async def soak(url: str, pid: int, key: str, work: Workload, duration: float, clients: int, rss_every: float,
               probe_every: float, warmup_share: float) -> tuple[dict[str, object], list[dict[str, object]]]:
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        ready = await client.get("/readyz")
        if ready.status_code != 200:
            raise SystemExit(f"{url} is not ready: HTTP {ready.status_code} {ready.text[:200]}")
        before = proc_counts(pid)
        rss_start = proc_rss_mb(pid)
        load_start = loadavg()
        tally = Tally()
        health: list[float] = []
        rss: list[tuple[float, float, int]] = []
        stop = asyncio.Event()
        start = time.perf_counter()

        async def read() -> float:
            return proc_rss_mb(pid)

        watchers = [asyncio.create_task(health_probe(url, probe_every, stop, health)),
                    asyncio.create_task(rss_sampler(read, rss_every, stop, start, tally_size(tally), rss))]
        await asyncio.gather(*(soak_client(client, work, key, start + duration, 7000 + c, tally)
                               for c in range(clients)))
        elapsed = time.perf_counter() - start
        stop.set()
        await asyncio.gather(*watchers)
        after = proc_counts(pid)
        rss_end = proc_rss_mb(pid)
    warm = warmup_share * duration
    slope, change, n_fit = slope_per_1000(rss, warm)
    half = slope_per_1000(rss, warm + (duration - warm) / 2)
    routes = {
        route: {"requests": len(lat), "statuses": dict(tally.statuses[route]),
                "p50_ms": round(percentile(lat, 50), 1), "p99_ms": round(percentile(lat, 99), 1),
                "first_error": tally.samples.get(route)}
        for route, lat in sorted(tally.latencies.items())
    }
    summary: dict[str, object] = {
        "seconds": round(elapsed, 1), "clients": clients, "requests": tally.requests,
        "rps": round(tally.requests / elapsed, 2), "routes": routes,
        "non_2xx": sum(v for r in tally.statuses.values() for k, v in r.items() if not k.startswith("2")),
        "health": {"n": len(health), "p50_ms": round(percentile(health, 50), 1),
                   "p99_ms": round(percentile(health, 99), 1),
                   "max_ms": round(max(health, default=float("nan")) * 1000, 1)},
        "rss_mb": {"start": round(rss_start, 1), "end": round(rss_end, 1),
                   "max": max((m for _, m, _ in rss), default=float("nan")),
                   "warmup_s": round(warm, 1), "after_warmup_samples": n_fit,
                   "slope_mb_per_1000_requests": round(slope, 3), "change_after_warmup_mb": round(change, 1),
                   "slope_mb_per_1000_requests_second_half": round(half[0], 3)},
        "loadavg_1m": {"start": load_start, "end": loadavg()},
        "fds": {"start": before["fds"], "end": after["fds"]},
        "threads": {"start": before["threads"], "end": after["threads"]},
    }
    samples = [{"scenario": "soak", "clients": clients, "t_s": t, "rss_mb": m, "requests": n} for t, m, n in rss]
    return summary, samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the running service's base URL (loopback only)")
    ap.add_argument("--pid", type=int, required=True, help="the server's process id (RSS, fds, threads)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between two RSS samples")
    ap.add_argument("--probe-every", type=float, default=0.5, help="seconds between two /healthz probes")
    ap.add_argument("--warmup-share", type=float, default=0.2, help="share of the run left out of the RSS fit")
    ap.add_argument("--k", type=int, default=10, help="results per query")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="queries: dev captions; upload: a dev image")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json", help="the CSV written")
    ap.add_argument("--samples-out", type=Path, default=RESULTS / "soak-rss.csv", help="CSV of the RSS samples")
    ap.add_argument("--note", default="", help="what the server ran on (model, index), kept in the results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    secret = from_environment().api_key  # the server's key: FRAGSEARCH_API_KEY, .env or fragsearch.toml
    key = secret.get_secret_value() if secret is not None else ""
    if not key:
        ap.error("set FRAGSEARCH_API_KEY to the server's key (the soak adds and deletes images)")
    if args.clients < 1 or args.duration <= 0 or not 0 <= args.warmup_share < 1:
        ap.error("--clients and --duration must be positive, --warmup-share in [0, 1)")
    work = load_workload(args.data, args.k)
    summary, samples = asyncio.run(soak(args.url, args.pid, key, work, args.duration, args.clients, args.rss_every,
                                        args.probe_every, args.warmup_share))
    summary.update(machine=machine(), note=args.note,
                   command="python -m bench.soak_bench " + shlex.join(sys.argv[1:] if argv is None else argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    write_csv(args.samples_out, SAMPLE_FIELDS, samples)
    logger.info("soak: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
