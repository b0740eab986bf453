"""Deprecated location: the analysis options live in :mod:`normflat.engine.options`."""

from normflat.engine.options import *  # noqa: F401,F403
from normflat.engine.options import __all__  # noqa: F401
