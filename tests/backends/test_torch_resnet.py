"""A model not written for normflat: a small ResNet in torchvision's style (BasicBlock,
BatchNorm, in-place ReLUs, projection shortcuts, global pooling) analyzes with every estimator."""

from __future__ import annotations

import math

import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import normflat  # noqa: E402


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """As torchvision.models.resnet.BasicBlock."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TinyResNet(nn.Module):
    """torchvision's ResNet layout with two stages of one BasicBlock each."""

    def __init__(self, num_classes=4, width=4):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, 1)
        self.layer2 = self._make_layer(2 * width, 1, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes, stride), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@pytest.fixture(scope="module")
def trained():
    """A few SGD steps in train mode, so BatchNorm has real running statistics."""
    torch.manual_seed(0)
    model = TinyResNet().double()
    x = torch.randn(24, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (24,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, DataLoader(TensorDataset(x, y), batch_size=10)


NAMES = ["conv1", "layer1.0.conv1", "layer1.0.conv2", "layer2.0.conv1", "layer2.0.conv2",
         "layer2.0.downsample.0", "fc"]


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "hutchinson", "exact"])
def test_resnet_analyzes_with_every_estimator(trained, estimator):
    model, loader = trained
    state = {k: v.clone() for k, v in model.state_dict().items()}
    samples = {"ggn-mc": 4, "hutchinson": 4}.get(estimator)
    report = normflat.analyze(model, loader, estimator=estimator, samples=samples, progress=False)
    assert [layer.name for layer in report.layers] == NAMES
    assert report.metadata["examples"] == 24 and report.metadata["batches"] == 3
    for value in report.totals.values():
        assert math.isfinite(value)
    assert report.normalized_sharpness > 0
    if estimator == "ggn":
        assert all(layer.details["path"] == "fast" for layer in report.layers)
    if samples:
        assert report.standard_error is not None
    assert model.training  # the model was left in train mode and stays there
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_resnet_fast_ggn_equals_generic(trained):
    model, loader = trained
    fast = normflat.hessian_diagonal(model, loader, estimator="ggn", progress=False)
    generic = normflat.hessian_diagonal(model, loader, estimator="ggn", progress=False, fast=False)
    assert list(fast) == NAMES
    for name in NAMES:
        torch.testing.assert_close(fast[name], generic[name], atol=1e-12, rtol=1e-9)
