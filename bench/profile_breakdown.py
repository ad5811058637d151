"""Where a served request's time goes: py-spy's samples of the service under load, summed by stage.

    py-spy record -f raw -r 250 -o /tmp/search8.txt -- python -m fragsearch.service --port 8011 &
    python -m bench.load_bench --url http://127.0.0.1:8011 --clients 8 --duration 30 --warmup 3 \\
        --scenarios search --out /tmp/load.csv
    kill -INT <the service's pid>             # py-spy writes its samples when the service exits
    python -m bench.profile_breakdown /tmp/search8.txt --name "search, 8 clients" \\
        --out docs/results/http-profile-search.csv --merge

Each sample (a thread's stack, py-spy's raw "frame;frame;... count" lines) goes to the stage of its deepest
frame that names one (`STAGES`, by the file or function in the frame); samples of waiting threads (a lock, a
selector, the thread pool's queue) and of the start-up (loading, warm-up) are counted apart. The shares are of
the busy samples: the CPU the requests took, as Python's threads saw it (time inside a native call that keeps
its thread, NumPy's BLAS and ONNX Runtime on the calling thread, is counted where it was called from).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

from bench import machine, parse_run, write_rows
from bench.photo_decode import cpu_flags

WAITING = ("Condition.wait", "EpollSelector.select", "select (selectors", "Event.wait", "Thread.join",
           "_worker (concurrent", "sleep")
START_UP = ("Engine.load", "prepare (", "warm_up", "_find_and_load", "read_model", "file_digest", "lifespan",
            "Bundle.load", "settle_heap", "prepare_and_load", "FragmentIndex._load", "_from_opened")
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("parse (spaCy)", ("parsers.py",)),
    ("MiniLM (ONNX Runtime)", ("minilm.py",)),
    ("encoders", ("encoders.py",)),
    ("calibration scale", ("calibrate_sentences",)),
    ("phrase evidence and grounding of the page", ("aligned_all", "read_sentence")),
    ("exact scan and re-rank", ("ranker.py",)),
    ("FAISS candidates", ("ann.py",)),
    ("sentence fragments, the rest (tokens, triplets, padding)", ("embed.py", "fragments.py", "words.py", "text.py")),
    ("relevance and cut-off", ("relevances (service", "shown (service", "relevance_at", "cut_off",
                               "Relevance.")),
    ("response: result models and JSON", ("image_result", "sentence_result", "match_out", "pydantic",
                                          "serialize_response", "jsonable", "json/", "render (")),
    ("admission gates", ("admission.py",)),
    ("HTTP framework (uvicorn, starlette, fastapi, anyio, asyncio)", ("uvicorn", "starlette", "fastapi", "anyio",
                                                                      "asyncio", "h11", "httptools")),
)


def stage_of(frames: list[str]) -> str:
    """The stage of a busy sample: its deepest frame's that names one, else "other"."""
    for frame in reversed(frames):
        for name, keys in STAGES:
            if any(k in frame for k in keys):
                return name
    return "other"


def breakdown(path: Path) -> tuple[Counter[str], int, int, int]:
    """(busy samples by stage, all samples, waiting ones, start-up ones) of a py-spy raw file."""
    stages: Counter[str] = Counter()
    total = waiting = start = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        if any(w in frames[-1] for w in WAITING):
            waiting += n
        elif any(s in f for f in frames for s in START_UP):
            start += n
        else:
            stages[stage_of(frames)] += n
    return stages, total, waiting, start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", type=Path, help="py-spy's raw output (record -f raw)")
    ap.add_argument("--name", required=True, help="the rows' profile cell: what was served and sent")
    ap.add_argument("--out", type=Path, default=Path("docs/results/http-profile-search.csv"), help="the results CSV")
    ap.add_argument("--merge", action="store_true", help="keep the rows of other profiles already in the results")
    args, command = parse_run(ap, argv, "bench.profile_breakdown")
    stages, total, waiting, start = breakdown(args.samples)
    busy = sum(stages.values())
    rows: list[dict[str, object]] = [
        {"profile": args.name, "stage": name, "share_of_busy": round(stages[name] / max(busy, 1), 4),
         "samples": stages[name], "busy_samples": busy, "waiting_samples": waiting, "start_up_samples": start,
         "all_samples": total, "machine": machine(), "cpu_flags": cpu_flags(), "command": command}
        for name in [*(n for n, _ in STAGES), "other"]]
    kept: list[dict[str, object]] = []
    if args.merge and args.out.is_file():
        with args.out.open(newline="") as fh:
            kept = [dict(r) for r in csv.DictReader(fh) if r["profile"] != args.name]
    write_rows(args.out, list(rows[0]), [*kept, *rows])


if __name__ == "__main__":
    main()
