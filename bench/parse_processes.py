"""The sentence collection's parse in one process and shared among several, side by side:

    python -m bench.parse_processes --processes 1 2 --rounds 2 --out docs/results/parse-processes.csv

The first `--captions` training captions (30,000: the default sentence collection a first start parses) are
parsed by model/parsers.py `SpacyParser` with each count of processes in turn, `--rounds` times (the counts
alternating within a round, so that a busy machine slows them alike); every parse is checked equal to the one
process's. Writes per count the median seconds, the captions a second, the ratio to the first count and whether
the parses were equal, with the machine and the command.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np

from bench import machine, parse_run, write_rows
from fragsearch.model.data import load_split
from fragsearch.model.parsers import SpacyParser
from fragsearch.model.resources import cpu_record
from fragsearch.settings import default_data_dir

logger = logging.getLogger("bench.parse_processes")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "parse-processes.csv"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--captions", type=int, default=30_000, help="the first N training captions")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2],
                    help="the counts of processes compared (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=2, help="times each count parses the captions")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    args, command = parse_run(ap, argv, "bench.parse_processes")
    sentences, _ = load_split(args.data, "train").sentences()
    sentences = sentences[: args.captions]
    parsers = {n: SpacyParser(processes=n) for n in args.processes}
    reference = None
    seconds: dict[int, list[float]] = {n: [] for n in args.processes}
    equal = dict.fromkeys(args.processes, True)
    for _ in range(args.rounds):
        for n, parser in parsers.items():
            t0 = time.perf_counter()
            parsed = parser.parse(sentences)
            seconds[n].append(time.perf_counter() - t0)
            reference = parsed if reference is None else reference
            equal[n] = equal[n] and parsed == reference
            logger.info("%d process(es): %.1f s", n, seconds[n][-1])
    first = float(np.median(seconds[args.processes[0]]))
    flags = " ".join(cpu_record()["flags"])
    rows: list[dict[str, object]] = []
    for n in args.processes:
        median = float(np.median(seconds[n]))
        rows.append({"processes": n, "captions": len(sentences), "rounds": args.rounds, "median_s": round(median, 2),
                     "captions_per_s": round(len(sentences) / median), "speedup": round(first / median, 2),
                     "parses_equal": equal[n], "machine": f"{machine()}; {flags}", "command": command})
        logger.info("%d process(es): median %.1f s (%.2fx), parses equal: %s", n, median, first / median, equal[n])
    write_rows(args.out, list(rows[0]), rows)
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
