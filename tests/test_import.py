"""`import normflat` and core calls import no deep-learning framework."""

import subprocess
import sys
import textwrap


def test_import_normflat_imports_no_framework():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import normflat
        import normflat.engine, normflat.engine.driver, normflat.engine.losses, normflat.engine.random
        import normflat.integrations
        w = np.ones((3, 2)); h = np.ones((3, 2))
        normflat.analyze([normflat.LayerProblem("a", w, h)]).to_json()
        normflat.normalized_sharpness(w, h)
        loaded = sorted(m for m in sys.modules
                        if m.split(".")[0] in {"torch", "tensorflow", "jax", "jaxlib", "keras", "flax", "equinox"})
        print(loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
