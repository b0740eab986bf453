"""Helpers shared by the benchmark scripts (timing, memory-vs-chunk tables)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

#: Chunk-size settings compared by the scaling benchmarks.
MEMORY_OPTIONS = (
    {"chunk_size": 8}, {"chunk_size": 32}, {"chunk_size": 128}, {"chunk_size": 256},
    {"memory_budget": "64MB"}, {"memory_budget": "256MB"}, {"memory_budget": "1GB"},
)


def time_interleaved(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time of each run after one warm-up call (compilation, tracing).

    The runs alternate within each round so that slow drifts of the machine hit
    every method alike.
    """
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(repeats):
        for m, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(t) for m, t in times.items()}


def memory_vs_chunk(measure: Callable[[dict], dict], title: str) -> list[dict]:
    """Run ``measure(options)`` for every :data:`MEMORY_OPTIONS` entry and print a table.

    ``measure`` returns ``chunk_size``, ``peak_added_mb`` and ``seconds`` (measured in
    a fresh process by the caller, so peaks do not mix).
    """
    rows = [{"options": options, **measure(options)} for options in MEMORY_OPTIONS]
    print(f"\n{title}")
    print("| option | chunk size | peak memory added (MiB) | s per pass |\n|---|---|---|---|")
    for row in rows:
        (key, value), = row["options"].items()
        print(f"| {key}={value!r} | {row['chunk_size']} | {row['peak_added_mb']:.0f} | {row['seconds']:.2f} |")
    return rows


def print_throughput(rows: list[dict], unit: str, title: str) -> None:
    """Markdown table of ``samples_per_s`` per row, relative to the first (one ``unit``)."""
    print(f"\n{title}")
    print(f"| {unit}s | samples/s | s per pass | vs 1 {unit} |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row[unit + 's']} | {row['samples_per_s']:.0f} | {row['seconds']:.2f} | "
              f"{row['samples_per_s'] / rows[0]['samples_per_s']:.2f}x |")


def scaling_main(doc: str, throughput: Callable[[int, int], Any], memory: Callable[[], Any]) -> None:
    """Command line of the scaling benchmarks: ``--section``, ``--samples``, ``--repeats``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--section", choices=("throughput", "memory", "all"), default="all")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.section in ("throughput", "all"):
        throughput(args.samples, args.repeats)
    if args.section in ("memory", "all"):
        memory()
