"""Wide ResNet (Zagoruyko & Komodakis, 2016) as a ``normflat study --model`` factory.

The paper's headline experiment (Tsuzuku, Sato & Sugiyama, ICML 2020, Fig. 1)
trains WRN-16-4 on CIFAR-10 with partially random labels. This file builds that
network for ``normflat study``::

    normflat study --model examples/study/wrn.py:wide_resnet \\
        --dataset examples/study/cifar10.py:load --device cuda --precision mixed ...

(the full command is in ``docs/study.md``). The network follows the reference
implementation of "Wide Residual Networks" (BMVC 2016): a 3x3 stem convolution
with 16 channels, three groups of ``(depth - 4) / 6`` pre-activation basic blocks
(BatchNorm -> ReLU -> 3x3 conv -> BatchNorm -> ReLU -> 3x3 conv, plus the
shortcut; a 1x1 convolution on the pre-activated input where the shape changes)
of ``16k``, ``32k`` and ``64k`` channels (``k = widen``; stride 2 at the start of
the second and third group), then BatchNorm -> ReLU -> global average pooling ->
a linear classifier. Initialization as in the reference: He-normal (fan-out)
convolutions, BatchNorm weight 1 and bias 0, linear bias 0.

Every block's first convolution feeds only its BatchNorm, so the study's
rescaler (``normflat.study.reparametrize``, which traces the module with
torch.fx) rescales those channels without changing the function, and the
reparametrization arm runs on this model.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "WideResNet", "wide_resnet"]


class BasicBlock(nn.Module):
    """A pre-activation residual block: BN -> ReLU -> conv3x3 -> BN -> ReLU -> conv3x3, plus the shortcut.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        stride: Stride of the first convolution (and of the shortcut).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        # Where the shape changes the shortcut is a 1x1 convolution of the
        # pre-activated input, as in the reference implementation.
        self.shortcut = (None if in_channels == out_channels and stride == 1
                         else nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu1(self.bn1(x))
        out = self.conv2(self.relu2(self.bn2(self.conv1(pre))))
        return out + (x if self.shortcut is None else self.shortcut(pre))


class WideResNet(nn.Module):
    """WRN-``depth``-``widen`` for images of shape ``(channels, height, width)``.

    Args:
        depth: Total depth ``6 n + 4`` (16 for WRN-16-k).
        widen: Widening factor ``k``.
        num_classes: Number of outputs.
        in_channels: Channels of the input images.
        base_width: Channels of the first group before widening (16 in the paper).
    """

    def __init__(self, depth: int = 16, widen: int = 4, num_classes: int = 10, in_channels: int = 3,
                 base_width: int = 16) -> None:
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise ValueError(f"Wide ResNet depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, ...), got {depth}.")
        if widen < 1 or base_width < 1:
            raise ValueError(f"widen and width must be positive, got widen={widen}, width={base_width}.")
        blocks = (depth - 4) // 6
        widths = [base_width * widen, 2 * base_width * widen, 4 * base_width * widen]
        self.conv = nn.Conv2d(in_channels, base_width, 3, padding=1, bias=False)
        layers, channels = [], base_width
        for group, out_channels in enumerate(widths):
            for i in range(blocks):
                layers.append(BasicBlock(channels, out_channels, stride=2 if (group > 0 and i == 0) else 1))
                channels = out_channels
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn(self.blocks(self.conv(x))))
        return self.fc(self.flatten(self.pool(out)))


def wide_resnet(input_shape: tuple[int, ...], num_classes: int, width: int | None = None, seed: int = 0,
                depth: int = 16, widen: int = 4) -> WideResNet:
    """A freshly initialized WRN-``depth``-``widen``: the ``normflat study --model`` factory.

    Args:
        input_shape: ``(channels, height, width)`` of one image (NCHW, as the
            CIFAR-10 loader of ``examples/study/cifar10.py`` gives them).
        num_classes: Number of outputs.
        width: Channels of the first group before widening (``--width``; default
            16, the paper's): ``--width 8,16`` puts a width axis in the study.
        seed: Seed of the initialization (torch's global generator is left as it was).
        depth: Total depth ``6 n + 4``.
        widen: Widening factor.

    Returns:
        The model in float32, train mode, on the CPU (the study moves it to ``--device``).
    """
    if len(input_shape) != 3:
        raise ValueError(f"wide_resnet takes images of shape (channels, height, width), got input_shape "
                         f"{tuple(input_shape)}; pass an image dataset in NCHW layout.")
    # fork_rng: the seeded initialization must not move the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WideResNet(depth=depth, widen=widen, num_classes=num_classes, in_channels=input_shape[0],
                          base_width=16 if width is None else width)
