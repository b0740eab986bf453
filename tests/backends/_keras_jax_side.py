"""Run a Keras model's analysis on Keras' JAX backend, in a fresh interpreter.

Keras' backend is fixed per process when keras is imported (the test process runs the TensorFlow
one), so the JAX side of a cross-backend test runs in a subprocess with ``KERAS_BACKEND=jax``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_on_jax(code: str) -> dict:
    """Run ``code`` (with ``keras`` and ``np`` imported; it fills a dict ``out``) on Keras' JAX backend
    and return ``out`` (JSON-serializable)."""
    program = "import json, keras, numpy as np\n" + code + '\nprint("RESULT", json.dumps(out))\n'
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
