"""The study's PyTorch models: a ReLU MLP and a LeNet-style CNN with or without BatchNorm.

All are plain ``nn.Sequential`` stacks of ``Flatten``, ``Linear``, ``Conv2d``,
``BatchNorm2d``, ``ReLU`` and ``MaxPool2d``, so that
:mod:`normflat.study.reparametrize` can rescale them without changing their function.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARCHITECTURES", "build_model"]

#: Architecture names accepted by :func:`build_model`.
ARCHITECTURES = ("mlp", "cnn", "cnn-bn")


def build_model(arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None = None, seed: int = 0) -> Any:
    """A freshly initialized torch model.

    Args:
        arch: ``"mlp"`` (two hidden ReLU layers), ``"cnn"`` (LeNet-style: two
            conv + max-pool stages and two dense layers) or ``"cnn-bn"`` (the
            same with BatchNorm after each convolution).
        input_shape: ``(channels, height, width)`` of one image.
        num_classes: Number of outputs.
        width: Hidden width of the MLP (default 128) or of the CNN's dense layer
            (default 128 for 8x8 inputs, 120 otherwise).
        seed: Seed of the initialization.

    Returns:
        A ``torch.nn.Sequential`` in float32, train mode.
    """
    import torch
    from torch import nn

    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (channels, height, width), got {input_shape}.")
    channels, height, wide = input_shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "mlp":
            hidden = width or 128
            return nn.Sequential(
                nn.Flatten(),
                nn.Linear(channels * height * wide, hidden), nn.ReLU(),
                nn.Linear(hidden, hidden), nn.ReLU(),
                nn.Linear(hidden, num_classes),
            )
        bn = arch == "cnn-bn"
        small = min(height, wide) < 16
        # 8x8 digits: 3x3 'same' convolutions; 28x28 images: LeNet-5's 5x5 kernels.
        k, pad = (3, 1) if small else (5, 2)
        c1, c2 = (16, 32) if small else (6, 16)

        def stage(cin, cout, padding):
            layers = [nn.Conv2d(cin, cout, k, padding=padding)]
            if bn:
                layers.append(nn.BatchNorm2d(cout))
            layers += [nn.ReLU(), nn.MaxPool2d(2)]
            return layers

        features = [*stage(channels, c1, pad), *stage(c1, c2, 1 if small else 0)]
        probe = nn.Sequential(*features).eval()
        with torch.no_grad():
            flat = probe(torch.zeros(1, *input_shape)).numel()
        hidden = width or (128 if small else 120)
        model = nn.Sequential(
            *features,
            nn.Flatten(),
            nn.Linear(flat, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        return model.train()  # the shape probe left the shared feature modules in eval mode
