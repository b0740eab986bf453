"""normflat.integrations holds the training-time hooks; normflat.keras is an alias of its Keras module."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.builders import require_frameworks

FRAMEWORKS = {"torch", "tensorflow", "jax", "jaxlib", "keras", "flax", "equinox", "lightning", "transformers"}


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_integrations_package_imports_no_framework():
    code = f"""
        import sys
        import normflat.integrations
        print(sorted(m for m in sys.modules if m.split(".")[0] in {sorted(FRAMEWORKS)!r}))
        """
    assert _run(code) == "[]"


def test_normflat_keras_is_an_alias_of_the_integration():
    require_frameworks("tensorflow", "keras")
    code = """
        import os
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import normflat.backends.keras as backend
        import normflat.integrations.keras as new
        import normflat.keras as old
        assert old.SharpnessCallback is new.SharpnessCallback
        for name in ("KerasWeight", "register_layer", "registered_layers"):
            assert getattr(old, name) is getattr(new, name) is getattr(backend, name), name
        assert new.SharpnessCallback.__module__ == "normflat.integrations.keras"
        assert "alias" in old.__doc__.lower()
        print("ok")
        """
    assert _run(code).splitlines()[-1] == "ok"
