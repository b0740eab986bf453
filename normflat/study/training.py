"""Training on partially random labels (Zhang et al. 2017), as in the paper's §6.1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["corrupt_labels", "TrainResult", "train_model", "accuracy", "PRECISIONS", "autocast_dtype"]


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


def _model_device(model: Any) -> Any:
    """The device of the model's first parameter or buffer (CPU for a model without any)."""
    import torch

    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def accuracy(model: Any, x: Any, y: Any, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` (used in its current mode) on tensors ``x``, ``y``.

    Each batch is moved to the model's device, so ``x`` and ``y`` may stay on the CPU.
    """
    import torch

    device = _model_device(model)
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            logits = model(x[start:start + batch_size].to(device))
            correct += int((logits.argmax(1) == y[start:start + batch_size].to(device)).sum())
    return correct / max(len(y), 1)


#: Training precisions: ``float32``, or ``mixed`` (torch autocast in the forward pass).
PRECISIONS = ("float32", "mixed")


def autocast_dtype(device_type: str) -> Any:
    """The autocast dtype of ``--precision mixed``: float16 on CUDA (with a GradScaler),
    bfloat16 on the CPU (float16 matmuls are slow or missing there, and bfloat16 needs no
    loss scaling)."""
    import torch

    return torch.float16 if device_type == "cuda" else torch.bfloat16


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
    precision: str = "float32",
) -> TrainResult:
    """Train ``model`` in place with cross-entropy until it fits the labels or ``epochs`` run out.

    Training runs on the model's device; ``x`` and ``y`` are moved there once.

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
        precision: ``"float32"``, or ``"mixed"``: the forward pass and the loss of
            each training step run under :func:`torch.autocast` (float16 with a
            GradScaler on CUDA, bfloat16 on the CPU); the weights, the optimizer
            and the per-epoch accuracy stay in float32.
    """
    import time

    import torch
    import torch.nn.functional as F

    from tqdm.auto import tqdm

    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    device = _model_device(model)
    x, y = x.to(device), y.to(device)
    mixed = precision == "mixed"
    amp_dtype = autocast_dtype(device.type)
    # float16 gradients underflow without loss scaling; bfloat16 has float32's range.
    scaler = torch.amp.GradScaler(device.type) if mixed and amp_dtype == torch.float16 else None

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
        perm = torch.randperm(n, generator=gen).to(device)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            if len(idx) < 2 and n >= 2:
                continue  # BatchNorm cannot train on a batch of one
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=mixed):
                logits = model(x[idx])
            loss = F.cross_entropy(logits.float(), y[idx])
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
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
