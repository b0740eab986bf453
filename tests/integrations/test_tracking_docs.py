"""docs/tracking.md shows the examples as they are, with the figures they produce."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("track_*.py"))


def test_every_framework_has_an_example():
    assert {p.stem for p in EXAMPLES} == {"track_torch", "track_lightning", "track_huggingface", "track_keras",
                                          "track_jax"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_the_page_shows_the_example_verbatim_and_its_figure(example):
    page = (ROOT / "docs" / "tracking.md").read_text()
    code = example.read_text().rstrip("\n")
    assert f"```python\n{code}\n```" in page, f"docs/tracking.md is out of date for {example.name}"
    ast.parse(code)
    figure = f"img/tracking_{example.stem.removeprefix('track_')}.png"
    assert f"]({figure})" in page and (ROOT / "docs" / figure).stat().st_size > 10_000
