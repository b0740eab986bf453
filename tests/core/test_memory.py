"""Memory budgets: parsing and chunk sizes (framework-free)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from normflat.core.memory import chunk_size_for, equal_step, format_bytes, parse_memory_budget


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        (1, 1),
        (123456, 123456),
        ("4096", 4096),
        ("10B", 10),
        ("512MB", 512 * 10**6),
        ("2GB", 2 * 10**9),
        ("2 gb", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("512MiB", 512 * 2**20),
        ("3KiB", 3 * 1024),
        ("1TB", 10**12),
        (" 7 kb ", 7000),
        (".5KiB", 512),
    ],
)
def test_parse_memory_budget(value, expected):
    assert parse_memory_budget(value) == expected


@pytest.mark.parametrize("value", ["", "MB", "12XB", "1e9", "-5MB", "2 G B", "1.2.3GB", "0", "0.1B"])
def test_parse_memory_budget_rejects_malformed(value):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_memory_budget(value)


@pytest.mark.parametrize("value", [0, -1])
def test_parse_memory_budget_rejects_non_positive_ints(value):
    with pytest.raises(ValueError, match="positive"):
        parse_memory_budget(value)


@pytest.mark.parametrize("value", [True, 1.5, [1], b"1MB"])
def test_parse_memory_budget_rejects_types(value):
    with pytest.raises(TypeError, match="memory_budget"):
        parse_memory_budget(value)


def test_chunk_size_for_rounds_down_and_caps():
    assert chunk_size_for(1000, 300) == 3
    assert chunk_size_for(900, 300) == 3
    assert chunk_size_for(899, 300) == 2
    assert chunk_size_for(300, 300) == 1
    assert chunk_size_for(10**9, 1, maximum=64) == 64
    assert chunk_size_for(10, 1, maximum=64) == 10


def test_chunk_size_for_one_sample_too_large_names_budget_and_need():
    with pytest.raises(ValueError) as info:
        chunk_size_for(1000, 4096, what="the GGN signals of layer 'dense'")
    message = str(info.value)
    assert "1000 bytes" in message and "4096 bytes" in message
    assert "layer 'dense'" in message and "Raise memory_budget" in message


def test_chunk_size_for_rejects_non_positive():
    with pytest.raises(ValueError):
        chunk_size_for(0, 10)
    with pytest.raises(ValueError):
        chunk_size_for(10, 0)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"


def test_memory_module_is_framework_free():
    code = (
        "import sys, normflat.core.memory; "
        "print([m for m in ('torch', 'tensorflow', 'jax', 'keras') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_default_budget_is_twice_a_training_step_less_the_sums():
    from normflat.core.memory import DEFAULT_BUDGET_FLOOR, default_budget, training_step_bytes

    step = training_step_bytes(parameters=10_000_000, activations=5_000_000, itemsize=4)
    assert step == 4 * (2 * 10_000_000 + 2 * 5_000_000)
    assert default_budget(step, state_bytes=40_000_000) == 2 * step - 40_000_000
    # Sums larger than the step (ggn-topk's groups): at least one step, never tiny chunks.
    assert default_budget(step, state_bytes=10 * step) == step
    assert default_budget(1000, 0) == DEFAULT_BUDGET_FLOOR


def test_equal_step_balances_the_same_number_of_steps():
    for total in range(1, 60):
        for most in range(1, 20):
            step = equal_step(total, most)
            assert 1 <= step <= most
            assert -(-total // step) == -(-total // most)  # as few steps as steps of `most`
            assert step * -(-total // step) - total < -(-total // step)  # balanced: less than one per step padded
    assert equal_step(20, 16) == 10 and equal_step(19, 6) == 5
