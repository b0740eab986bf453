"""The failure-agreement protocol of :mod:`normflat.engine.distributed`, with N threads.

:class:`tests.engine._fakes.ThreadComm` is an in-process ``Comm`` whose
collectives are a barrier-based all-gather; a rank that skipped a collective
would leave the others waiting at the barrier, which the fake turns into a
``BrokenBarrierError`` (the test then fails instead of hanging).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from normflat.engine import driver, validate_options
from normflat.engine.distributed import DistributedFailure, agree, step
from tests.engine._fakes import LinearSession, linear_ggn_diagonal, run_ranks


def test_agree_success():
    out = run_ranks(3, lambda comm: agree(comm, None, ["fc", (3, 2)]))
    assert out == [(None, None)] * 3


def test_agree_failing_rank_reraises_its_own_error():
    errors = {1: KeyError("bad layer")}

    def fn(comm):
        agree(comm, errors.get(comm.rank), None if comm.rank in errors else ["fc"])

    out = run_ranks(3, fn)
    assert out[1][1] is errors[1]
    for r in (0, 2):
        err = out[r][1]
        assert isinstance(err, DistributedFailure)
        assert f"stopped on rank {r}" in str(err)
        assert "1 of 3 ranks failed" in str(err) and "rank 1: KeyError" in str(err) and "bad layer" in str(err)


def test_agree_several_failures_are_all_named():
    errors = {0: ValueError("zero."), 2: TypeError("two")}
    out = run_ranks(3, lambda comm: agree(comm, errors.get(comm.rank), ["fc"]))
    assert out[0][1] is errors[0] and out[2][1] is errors[2]
    text = str(out[1][1])
    assert "2 of 3 ranks failed" in text and "rank 0: ValueError: zero;" in text and "rank 2: TypeError: two" in text


@pytest.mark.parametrize("sigs,needle", [
    ({1: ["fc", (3, 3)]}, "(3, 2) on rank 0 vs (3, 3) on rank 1"),
    ({2: ["fc"]}, "2 entries on rank 0 vs 1 on rank 2"),
])
def test_agree_signature_mismatch_raises_on_every_rank(sigs, needle):
    out = run_ranks(3, lambda comm: agree(comm, None, sigs.get(comm.rank, ["fc", (3, 2)])))
    for _, err in out:
        assert isinstance(err, ValueError) and not isinstance(err, DistributedFailure)
        assert "do not analyze the same model" in str(err) and needle in str(err)


def test_step_ranks_with_fewer_batches_keep_stepping():
    batches = {0: 1, 1: 4, 2: 0}

    def fn(comm):
        done = steps = 0
        while True:
            active = done < batches[comm.rank]
            done += active
            steps += 1
            if not step(comm, active, None, f"on batch {steps}"):
                return steps, done

    out = run_ranks(3, fn)
    # every rank answers the same number of steps: the longest shard plus the final all-idle one
    assert [res for res, _ in out] == [(5, 1), (5, 4), (5, 0)]


def test_step_failure_raises_everywhere():
    def fn(comm):
        for i in range(10):
            err = RuntimeError("oom on batch 2") if (comm.rank == 2 and i == 2) else None
            step(comm, True, err, f"on batch {i}")
        return "finished"

    out = run_ranks(4, fn)
    assert isinstance(out[2][1], RuntimeError) and str(out[2][1]) == "oom on batch 2"
    for r in (0, 1, 3):
        err = out[r][1]
        assert isinstance(err, DistributedFailure)
        assert "failed on batch 2" in str(err) and "rank 2: RuntimeError: oom on batch 2" in str(err)


# ----------------------------------------------------------------------------- through the driver


W = np.random.default_rng(0).normal(size=(3, 4))


def _shards(sizes, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(sum(sizes), 4))
    y = rng.integers(0, 3, size=len(x))
    out, start = [], 0
    for n in sizes:
        out.append((x[start:start + n], y[start:start + n]))
        start += n
    return x, y, out


def test_driver_distributed_equals_single_process():
    options = validate_options(loss="ce", progress=False)
    x, _, parts = _shards([3, 2, 4, 1, 2])
    shards = {0: [parts[0], parts[1], parts[2]], 1: [parts[3]], 2: [parts[4]]}  # uneven batch counts
    sessions = {}

    def fn(comm):
        def make():
            sessions[comm.rank] = LinearSession(W, options, rank=comm.rank)
            return sessions[comm.rank]

        return driver.run(make, shards[comm.rank], options, comm)

    out = run_ranks(3, fn)
    assert all(err is None for _, err in out), out
    ref = linear_ggn_diagonal(W, x, "ce")
    for rank, (res, _) in enumerate(out):
        np.testing.assert_allclose(res.diags[0], ref, rtol=1e-13)
        assert res.metadata["world_size"] == 3
        assert res.metadata["examples"] == 12 and res.metadata["batches"] == 5
        assert res.metadata["backend"]["examples_per_rank"] == [9, 1, 2]
        assert sessions[rank].closed == 1
    for res, _ in out[1:]:
        np.testing.assert_array_equal(res.diags[0], out[0][0].diags[0])  # identical on every rank


def test_driver_distributed_empty_shard_is_fine():
    options = validate_options(loss="ce", progress=False)
    x, _, parts = _shards([3, 2])
    shards = {0: parts, 1: []}
    out = run_ranks(2, lambda comm: driver.run(lambda: LinearSession(W, options, rank=comm.rank),
                                               shards[comm.rank], options, comm))
    assert all(err is None for _, err in out), out
    for res, _ in out:
        np.testing.assert_allclose(res.diags[0], linear_ggn_diagonal(W, x, "ce"), rtol=1e-13)


def test_driver_distributed_all_shards_empty():
    options = validate_options(loss="ce", progress=False)
    out = run_ranks(2, lambda comm: driver.run(lambda: LinearSession(W, options), [], options, comm))
    for _, err in out:
        assert isinstance(err, ValueError) and "empty on every rank" in str(err)


def test_driver_distributed_failure_in_update_closes_every_session():
    options = validate_options(loss="ce", progress=False)
    _, _, parts = _shards([2, 2, 2])
    sessions = {}

    def fn(comm):
        def make():
            sessions[comm.rank] = LinearSession(W, options, rank=comm.rank, fail_on=1 if comm.rank == 1 else None)
            return sessions[comm.rank]

        return driver.run(make, parts, options, comm)

    out = run_ranks(3, fn)
    assert isinstance(out[1][1], ValueError) and "update failed on batch 1" in str(out[1][1])
    for r in (0, 2):
        assert isinstance(out[r][1], DistributedFailure) and "rank 1: ValueError" in str(out[r][1])
    assert [sessions[r].closed for r in range(3)] == [1, 1, 1]
    # the healthy ranks stopped at the same step: none drew batch 2
    assert [sessions[r].updates for r in range(3)] == [[0, 1]] * 3


def test_driver_distributed_setup_failure_and_signature_mismatch():
    options = validate_options(loss="ce", progress=False)
    _, _, parts = _shards([2])

    def failing(comm):
        def make():
            if comm.rank == 0:
                raise TypeError("unknown layer type")
            return LinearSession(W, options)
        return driver.run(make, parts, options, comm)

    out = run_ranks(2, failing)
    assert isinstance(out[0][1], TypeError)
    assert isinstance(out[1][1], DistributedFailure) and "while setting up" in str(out[1][1])

    closed = []

    def mismatch(comm):
        session = LinearSession(W, options, signature_extra="bf16" if comm.rank else None)
        session.close = lambda: closed.append(comm.rank)
        return driver.run(lambda: session, parts, options, comm)

    out = run_ranks(2, mismatch)
    assert all(isinstance(err, ValueError) and "do not analyze the same model" in str(err) for _, err in out)
    assert sorted(closed) == [0, 1]


def test_thread_comm_really_synchronizes():
    # Sanity check of the fake itself: a rank that skips a collective breaks the barrier.
    def fn(comm):
        if comm.rank == 0:
            return None
        return comm.sum_ints([1])

    out = run_ranks(2, fn, timeout=0.5)
    assert isinstance(out[1][1], threading.BrokenBarrierError)


@pytest.mark.parametrize("every_rank", [True, False])
def test_driver_distributed_saturation_warning_is_decided_together(monkeypatch, every_rank):
    """The saturated-softmax warning (method §7) needs every rank's every sample saturated;
    the ranks decide together (an empty shard is neutral), so all warn or none does."""
    options = validate_options(loss="ce", progress=False)
    _, _, parts = _shards([3, 2, 4])
    big = [(x * 1e4, y) for x, y in parts]
    shards = {0: big[:2], 1: big[2:] if every_rank else parts[2:], 2: []}
    warned = []
    monkeypatch.setattr(driver, "warn_user", lambda message: warned.append(message))
    out = run_ranks(3, lambda comm: driver.run(lambda: LinearSession(W, options, rank=comm.rank),
                                               shards[comm.rank], options, comm))
    assert all(err is None for _, err in out), out
    assert len(warned) == (3 if every_rank else 0)
    assert all("saturated on every sample" in m for m in warned)
