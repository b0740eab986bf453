"""Helpers shared by the benchmark scripts (timing, memory-vs-chunk tables)."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any, Callable, Iterator

#: Chunk-size settings compared by the scaling benchmarks.
MEMORY_OPTIONS = (
    {"chunk_size": 8}, {"chunk_size": 32}, {"chunk_size": 128}, {"chunk_size": 256},
    {"memory_budget": "64MB"}, {"memory_budget": "256MB"}, {"memory_budget": "1GB"},
)


def time_rounds(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Wall times of each run over ``repeats`` rounds, after one warm-up call (compilation, tracing).

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
    return times


def time_interleaved(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time of each run over interleaved rounds (:func:`time_rounds`)."""
    return {m: statistics.median(t) for m, t in time_rounds(runs, repeats).items()}


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); ``OSError`` off Linux."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def reset_peak_kib() -> int:
    """Reset the peak-RSS mark (``VmHWM``) to the current resident set; return it in KiB.

    Linux only (``/proc/self/clear_refs``); ``OSError`` elsewhere.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_kib("VmRSS")


def value_from_fresh_process(target: Callable[..., None], args: tuple, timeout: float = 1800) -> float:
    """Run ``target(*args, queue)`` in a fresh (spawned) process and return what it puts on the queue.

    The process starts inside :func:`mmap_freed_blocks`, so that its peak-memory figures
    are not hidden by memory freed after a warm-up run.
    """
    return float(result_from_fresh_process(target, args, timeout, freed_blocks=True))


def result_from_fresh_process(target: Callable[..., None], args: tuple, timeout: float = 1800,
                              freed_blocks: bool = False) -> Any:
    """Run ``target(*args, queue)`` in a fresh (spawned) process and return what it puts on the
    queue; ``RuntimeError`` as soon as the process ends without a result. With ``freed_blocks``
    the process starts inside :func:`mmap_freed_blocks` (for peak-memory figures)."""
    import multiprocessing as mp
    import queue as queues

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results))
    with mmap_freed_blocks() if freed_blocks else contextlib.nullcontext():
        proc.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = results.get(timeout=5)
            break
        except queues.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{getattr(target, '__name__', target)}{args} ended without a result "
                                   f"(exit {proc.exitcode})") from None
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{getattr(target, '__name__', target)}{args} gave no result in {timeout} s")
    proc.join()
    return value


@contextlib.contextmanager
def mmap_freed_blocks() -> Iterator[None]:
    """Processes started inside the block have glibc serve blocks >= 64 KiB by mmap.

    Freed tensors then leave the resident set at once, so a warm-up run does not
    hide the measured run's allocations. Only this process's environment is
    changed, and only while the children start.
    """
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


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


#: The model-zoo tables' two header lines (``benchmarks/zoo.py``, ``benchmarks/keras_zoo.py``).
ZOO_HEADER = ("| model | parameters | loss | layers | coverage | skipped (no extractor) | fast | generic | generic reasons | "
              "fast vs generic | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|")


def zoo_row(name: str, build: Callable[[], tuple[Any, Callable[[int], Any]]], check: bool,
            parameters: Callable[[Any], str], largest: Callable[[Any], float], check_options: dict | None = None,
            reason: Callable[[str], str] = lambda r: r) -> str:
    """One model-zoo table row for the model ``build()`` makes (its errors, too: the row says what failed).

    ``normflat.analyze`` with the defaults on two batches (of 2 and 3 samples; ``loss="ce"`` where
    ``nsce`` refuses random-init logits nearly equal across classes); with ``check``, the largest
    difference between the fast and the generic path's GGN diagonals relative to each tensor's
    largest entry. The framework's parts: ``parameters(model)`` (the column's text), ``largest(a)``
    (an array's largest absolute entry), ``check_options`` (more options of the two diagonals) and
    ``reason`` (a generic path's reason as the table shows it).
    """
    import re

    import normflat

    start = time.perf_counter()
    try:
        model, batch = build()
        data = [batch(2), batch(3)]
        loss = "nsce"
        try:
            report = normflat.analyze(model, data, progress=False)
        except ValueError as err:
            if "nearly) equal across classes" not in str(err):
                raise
            loss = "ce"
            report = normflat.analyze(model, data, progress=False, loss=loss)
        seconds = time.perf_counter() - start
        generic = [layer.details.get("generic_reason") for layer in report.layers if layer.details["path"] == "generic"]
        reasons = "; ".join(sorted({reason(str(r))[:120] for r in generic}))
        skipped = sorted({m.group(1) for m in (re.search(r"\((\w+) has", str(u)) for u in report.metadata["unsupported"])
                          if m})
        agreement = "—"
        if check:
            options = dict(progress=False, loss="ce", estimator="ggn", **(check_options or {}))
            fast = normflat.hessian_diagonal(model, data, **options)
            slow = normflat.hessian_diagonal(model, data, fast=False, **options)
            # Per tensor: a layer of small curvature is not hidden behind the model's largest entry.
            worst = max((largest(fast[k] - slow[k]) / largest(slow[k]) for k in fast if largest(slow[k]) > 0),
                        default=0.0)
            agreement = f"{worst:.0e}"
        return (f"| {name} | {parameters(model)} | {loss} | {len(report.layers)} | {report.metadata['coverage']:.2f} | "
                f"{', '.join(skipped) or '—'} | {len(report.layers) - len(generic)} | {len(generic)} | "
                f"{reasons or '—'} | {agreement} | {seconds:.1f} |")
    except Exception as err:  # noqa: BLE001 - the row reports the failure
        return f"| {name} | — | — | — | — | — | — | — | failed: {type(err).__name__}: {str(err)[:120]} | — | — |"
