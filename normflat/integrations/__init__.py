"""Training-time integrations: watch normalized sharpness while a model trains.

This package holds the hooks that plug normflat into each framework's training
loop: the Keras callback now (:class:`normflat.integrations.keras.SharpnessCallback`),
and later PyTorch Lightning and Hugging Face ``Trainer`` callbacks and JAX
training-loop helpers. Each lives in its own submodule, named after its
framework, and imports that framework only when the submodule itself is
imported; importing this package imports no framework.
"""

__all__: list[str] = []
