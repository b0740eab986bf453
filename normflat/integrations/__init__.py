"""Training-time integrations: watch normalized sharpness while a model trains.

One submodule per framework, each importing its framework only when it is
itself imported (importing this package imports no framework):

=================================  ==============================================
``normflat.integrations.keras``    ``SharpnessCallback`` for ``model.fit``
``normflat.integrations.lightning`` ``SharpnessCallback`` for ``lightning.pytorch.Trainer``
``normflat.integrations.huggingface`` ``SharpnessCallback`` for ``transformers.Trainer``
``normflat.integrations.torch``    ``SharpnessTracker`` for hand-written PyTorch loops
``normflat.integrations.jax``      ``SharpnessTracker`` for optax loops (flax nnx, linen, equinox)
=================================  ==============================================

All take the analysis data first and the same options (``every_n_epochs`` or
``every_n_steps``, ``max_batches``, ``log``, ``per_layer``, ``prefix``,
``keep_reports`` and any :func:`normflat.analyze` option), share the schedule and
options core :class:`~normflat.integrations.tracking.Tracker`, and keep a
:class:`~normflat.integrations.history.TrackingHistory` that plots as
measure-vs-step curves. See ``docs/tracking.md``.
"""

from normflat.integrations.history import HistoryEntry, TrackingHistory
from normflat.integrations.tracking import Tracker, iterate_quietly

__all__ = ["HistoryEntry", "Tracker", "TrackingHistory", "iterate_quietly"]
