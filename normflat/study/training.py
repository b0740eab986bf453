"""Training on partially random labels (Zhang et al. 2017), as in the paper's §6.1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["corrupt_labels", "TrainResult", "train_model", "accuracy"]


def corrupt_labels(y: np.ndarray, ratio: float, num_classes: int, seed: int) -> np.ndarray:
    """Replace the labels of ``round(ratio · n)`` random examples by uniform random classes.

    A replaced label may coincide with the true one by chance (probability
    ``1/num_classes``), as in Zhang et al.'s partially corrupted labels.

    Args:
        y: True labels.
        ratio: Fraction of examples whose label is redrawn, in [0, 1].
        num_classes: Number of classes.
        seed: Seed of the choice of examples and of the new labels.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"Label-randomization ratios must lie in [0, 1], got {ratio}.")
    rng = np.random.default_rng(seed)
    y = np.array(y, dtype=np.int64, copy=True)
    idx = rng.permutation(len(y))[: int(round(ratio * len(y)))]
    y[idx] = rng.integers(0, num_classes, size=len(idx))
    return y


def accuracy(model: Any, x: Any, y: Any, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` (used in its current mode) on tensors ``x``, ``y``."""
    import torch

    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            logits = model(x[start:start + batch_size])
            correct += int((logits.argmax(1) == y[start:start + batch_size]).sum())
    return correct / max(len(y), 1)


@dataclass(frozen=True)
class TrainResult:
    """What happened during training.

    Attributes:
        epochs: Epochs run.
        train_accuracy: Accuracy on the (partially random) training labels at the end.
        train_loss: Mean cross-entropy of the last epoch.
        fitted: Whether the target training accuracy was reached.
        seconds: Wall time.
    """

    epochs: int
    train_accuracy: float
    train_loss: float
    fitted: bool
    seconds: float


def train_model(
    model: Any,
    x: Any,
    y: Any,
    *,
    epochs: int,
    lr: float = 1e-3,
    batch_size: int = 64,
    weight_decay: float = 0.0,
    optimizer: str = "adam",
    target_accuracy: float = 1.0,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
) -> TrainResult:
    """Train ``model`` in place with cross-entropy until it fits the labels or ``epochs`` run out.

    Args:
        model: A torch module (train mode is set here, eval mode on return).
        x: Training inputs (tensor).
        y: Training labels (tensor, possibly partially random).
        epochs: Maximum number of epochs.
        lr: Learning rate.
        batch_size: Minibatch size.
        weight_decay: L2 penalty (decoupled for Adam: AdamW).
        optimizer: ``"adam"`` or ``"sgd"`` (momentum 0.9).
        target_accuracy: Stop once the training accuracy (checked after each
            epoch, eval mode) reaches this value; ``> 1`` disables early stopping.
        seed: Seed of the minibatch order.
        progress: Show a tqdm bar over epochs.
        desc: Label of the progress bar.
    """
    import time

    import torch
    import torch.nn.functional as F

    from tqdm.auto import tqdm

    if optimizer == "adam":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    else:
        raise ValueError(f"Unknown optimizer {optimizer!r}; choose 'adam' or 'sgd'.")
    gen = torch.Generator().manual_seed(seed)
    n = len(y)
    start_time = time.perf_counter()
    acc, loss_value, epoch = 0.0, float("nan"), 0
    bar = tqdm(total=epochs, desc=desc, unit="epoch", leave=False, disable=not progress)
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            if len(idx) < 2 and n >= 2:
                continue  # BatchNorm cannot train on a batch of one
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        loss_value = total / n
        model.eval()
        acc = accuracy(model, x, y)
        bar.update(1)
        bar.set_postfix(acc=f"{acc:.3f}", loss=f"{loss_value:.3g}", refresh=False)
        if acc >= target_accuracy:
            break
    bar.close()
    model.eval()
    return TrainResult(epoch, acc, loss_value, acc >= target_accuracy, time.perf_counter() - start_time)
