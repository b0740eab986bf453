"""Benchmark: the torch GGN diagonal across processes (gloo, CPU) and against the chunk size.

Two measurements, on the benchmark MLP (784-512-256-10, batch 128) and the DeepOBS
3C3D CNN (batch 32) of :mod:`benchmarks.torch_diag`, ``estimator="ggn"``, float32,
random data, 10 classes:

* **scale-out**: the same data (``--batches`` batches) analyzed by 1 process and by
  2 processes (``torch.distributed`` with the gloo backend on 127.0.0.1, each rank
  a shard of the batches), each process with ``--threads`` threads. Throughput is
  all samples over the wall time of the slowest rank (the all-reduces included);
  peak memory is the peak resident-set growth of one rank during the run.
* **memory vs chunk size**: one process, one batch, ``chunk_size`` = samples per
  GGN step (and the chunk chosen by a few ``memory_budget`` values): peak
  resident-set growth and time.

Each measurement runs in fresh processes after a one-batch warm-up, so one-time
initialization is not counted. Peak memory uses Linux's ``/proc/self/clear_refs``
(VmHWM); elsewhere it is the process-wide high-water mark.

Run::

    python -m benchmarks.scaling [--batches 8] [--threads 1] [--problems mlp 3c3d] [--no-chunks]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import sys
import time
from typing import Any

import torch

import normflat
from benchmarks._common import mmap_freed_blocks, proc_status_kib, reset_peak_kib
from benchmarks.torch_diag import PROBLEMS

__all__ = ["scale_out", "chunk_sweep", "main"]

#: Chunk sizes (samples per GGN step) of the memory sweep, and memory budgets.
CHUNKS = (1, 4, 16, 64)
BUDGETS = ("1MB", "16MB", "64MB")


def _batches(problem: str, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = PROBLEMS[problem][1]
    out = []
    for i in indices:  # batch i is the same whichever rank draws it
        g = torch.Generator().manual_seed(1000 + i)
        out.append((torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)))
    return out


def _model(problem: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return PROBLEMS[problem][0]().eval()


def _reset_peak() -> int:
    """Reset the peak-RSS mark; returns the current RSS in KiB (or the high-water mark)."""
    try:
        return reset_peak_kib()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_growth_mib(before: int) -> float:
    try:
        return (proc_status_kib("VmHWM") - before) / 1024
    except OSError:
        import resource

        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def _rank(rank: int, world: int, port: int, problem: str, batches: int, threads: int, options: dict,
          queue) -> None:
    try:
        _measure(rank, world, port, problem, batches, threads, options, queue)
    except Exception as e:  # noqa: BLE001 - reported by the parent (e.g. a budget below one sample)
        queue.put((rank, None, None, None, None, f"{type(e).__name__}: {e}"))


def _measure(rank: int, world: int, port: int, problem: str, batches: int, threads: int, options: dict,
             queue) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world, timeout=datetime.timedelta(seconds=300))
    model = _model(problem)
    data = _batches(problem, list(range(rank, batches, world)))  # round-robin shard
    normflat.analyze(model, data[:1], progress=False, **options)  # warm-up, collectives included
    before = _reset_peak()
    if world > 1:
        torch.distributed.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    report = normflat.analyze(model, data, progress=False, **options)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    queue.put((rank, seconds, _peak_growth_mib(before), report.metadata.get("examples"),
               report.metadata.get("chunk_size"), report.normalized_sharpness, cpu))
    if world > 1:
        torch.distributed.destroy_process_group()


def _launch(world: int, problem: str, batches: int, threads: int, options: dict) -> list[tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mmap_freed_blocks():
        procs = [ctx.Process(target=_rank, args=(r, world, port, problem, batches, threads, options, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
    results: list[tuple] = []
    deadline = time.monotonic() + 1800
    while len(results) < world:
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: check that the ranks are still alive
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"benchmark ranks died or hung (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(60)
    return sorted(results, key=lambda r: r[0])


def scale_out(problems: tuple[str, ...] = tuple(PROBLEMS), batches: int = 8, threads: int = 1,
              worlds: tuple[int, ...] = (1, 2)) -> dict[str, dict[int, dict[str, Any]]]:
    """``{problem: {world size: {"samples_per_s", "seconds", "peak_mib_per_rank",
    "cpu_seconds_per_rank", "examples", "normalized_sharpness"}}}`` for the ggn estimator."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for problem in problems:
        out[problem] = {}
        for world in worlds:
            res = _launch(world, problem, batches, threads, {"estimator": "ggn"})
            if res[0][1] is None:
                raise RuntimeError(res[0][5])
            seconds = max(r[1] for r in res)
            examples = res[0][3]
            out[problem][world] = {
                "seconds": seconds,
                "samples_per_s": examples / seconds,
                "peak_mib_per_rank": [r[2] for r in res],
                "cpu_seconds_per_rank": [r[6] for r in res],
                "examples": examples,
                "normalized_sharpness": res[0][5],
            }
    return out


def chunk_sweep(problems: tuple[str, ...] = tuple(PROBLEMS), threads: int = 1) -> dict[str, list[dict[str, Any]]]:
    """``{problem: [{"setting", "chunk_size", "seconds", "peak_mib", "error"}, ...]}`` on one batch
    (``error``: the message when the setting is refused, e.g. a budget below one sample)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for problem in problems:
        settings: list[tuple[str, dict]] = [("default", {})]
        settings += [(f"chunk_size={c}", {"chunk_size": c}) for c in CHUNKS]
        settings += [(f"memory_budget={b!r}", {"memory_budget": b}) for b in BUDGETS]
        rows = []
        for label, opts in settings:
            (res,) = _launch(1, problem, 1, threads, {"estimator": "ggn", **opts})
            rows.append({"setting": label, "chunk_size": res[4], "seconds": res[1], "peak_mib": res[2],
                         "error": res[5] if res[1] is None else None})
        out[problem] = rows
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="batches of the whole data set")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--no-chunks", action="store_true", help="skip the memory vs chunk size sweep")
    args = parser.parse_args(argv)
    problems = tuple(args.problems)
    print(f"torch {torch.__version__}, CPU, gloo, {args.threads} thread(s) per process, "
          f"{os.cpu_count()} CPUs, ggn estimator, float32")
    figs = scale_out(problems, args.batches, args.threads)
    print("\nscale-out (the same data, sharded over the processes):")
    print(f"  {'problem':<8}{'procs':>6}{'samples':>9}{'seconds':>10}{'samples/s':>11}{'speed-up':>10}"
          f"{'CPU s/rank':>14}{'peak MiB/rank':>16}")
    for problem, by_world in figs.items():
        base = by_world[1]["samples_per_s"]
        for world, f in by_world.items():
            peaks = "/".join(f"{m:.0f}" for m in f["peak_mib_per_rank"])
            cpus = "/".join(f"{c:.2f}" for c in f["cpu_seconds_per_rank"])
            print(f"  {problem:<8}{world:>6}{f['examples']:>9}{f['seconds']:>10.2f}{f['samples_per_s']:>11.1f}"
                  f"{f['samples_per_s'] / base:>10.2f}{cpus:>14}{peaks:>16}")
        a, b = by_world[1]["normalized_sharpness"], by_world[2]["normalized_sharpness"]
        print(f"  {problem}: normalized sharpness 1 process {a:.6g}, 2 processes {b:.6g} "
              f"(relative difference {abs(a - b) / abs(a):.1e}, float32)")
    if not args.no_chunks:
        print("\nmemory vs chunk size (one batch, one process):")
        print(f"  {'problem':<8}{'setting':<26}{'chunk':>7}{'seconds':>10}{'peak MiB':>10}")
        for problem, rows in chunk_sweep(problems, args.threads).items():
            for r in rows:
                if r["error"]:
                    print(f"  {problem:<8}{r['setting']:<26}  refused: {r['error'][:110]}")
                    continue
                print(f"  {problem:<8}{r['setting']:<26}{str(r['chunk_size']):>7}{r['seconds']:>10.3f}"
                      f"{r['peak_mib']:>10.1f}")


if __name__ == "__main__":
    main()
