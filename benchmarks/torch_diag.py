"""Benchmark: normflat's GGN diagonal in PyTorch against one gradient and BackPACK.

Problems (float32, random data, 10 classes):

* ``mlp``: 784-512-256-10 ReLU MLP, batch 128;
* ``3c3d``: the DeepOBS 3C3D CIFAR-10 CNN (three conv + max-pool blocks, two
  hidden dense layers), batch 32;
* ``resnet8`` / ``resnet20``: He et al.'s CIFAR ResNets (16/32/64 channels, one or
  three basic blocks per stage, 1×1 projection shortcuts), BatchNorm in eval mode with
  random running statistics, batch 32 (BackPACK through its module converter, which
  turns the residual additions into modules it extends).

Methods: one gradient of the mean cross-entropy (``loss.backward()``), BackPACK
``DiagGGNExact`` and ``DiagGGNMC`` (one sample), normflat ``estimator="ggn"`` and
``"ggn-mc"`` (one sample), all with ``loss="ce"`` so the diagonals are the same
quantity: the exact ones are compared entry by entry, each one-sample estimate by its
relative error against the exact diagonal (``‖d̂ − d‖ / ‖d‖`` over all weights). Times are the
median of ``repeats`` runs after one warm-up run (methods
alternate within each round); peak memory is the peak
resident-set growth of one run after a warm-up run, in a fresh process (CPU) or
``torch.cuda.max_memory_allocated`` (CUDA).

Run::

    python -m benchmarks.torch_diag [--repeats 5] [--device cpu] [--no-memory]

Other benchmarks import :func:`torch_figures` (and the model factories) to
print the torch figures next to their own.

BackPACK is a benchmark-only dependency, see ``requirements-bench.txt``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import resource
import statistics
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn

import normflat
from benchmarks._common import proc_status_kib, reset_peak_kib, value_from_fresh_process

__all__ = ["mlp", "cnn_3c3d", "resnet_cifar", "PROBLEMS", "METHODS", "make_problem", "torch_figures", "main"]


def mlp() -> nn.Module:
    """784-512-256-10 ReLU MLP on flattened 28x28 images."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def cnn_3c3d() -> nn.Module:
    """DeepOBS 3C3D CIFAR-10 network (as in BackPACK's benchmarks)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(64, 96, 3), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(), nn.Linear(1152, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10),
    )


class _BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm and a shortcut (a 1×1 convolution with BatchNorm where
    the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
        # ReLU modules, one per use: BackPACK's converter extends modules, not functions.
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet_cifar(depth: int) -> nn.Module:
    """He et al.'s CIFAR ResNet of ``depth = 6n + 2`` layers (ResNet-8: n = 1, ResNet-20: n = 3):
    16, 32 and 64 channels in three stages of ``n`` basic blocks, global average pooling, 10 classes."""
    n = (depth - 2) // 6
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for stage, cout in enumerate((16, 32, 64)):
        for block in range(n):
            layers.append(_BasicBlock(cin, cout, 2 if stage > 0 and block == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


def _with_running_statistics(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The model with random BatchNorm running statistics and affine parameters (in eval mode they
    would otherwise be the identity's), so that the benchmark's BatchNorm layers compute something."""
    def make() -> nn.Module:
        model = factory()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.normal_(0.0, 0.2)
                    m.running_var.uniform_(0.5, 1.5)
                    m.weight.normal_(1.0, 0.2)
                    m.bias.normal_(0.0, 0.1)
        return model
    return make


#: name -> (model factory, input shape with batch axis)
PROBLEMS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (128, 1, 28, 28)),
    "3c3d": (cnn_3c3d, (32, 3, 32, 32)),
    "resnet8": (_with_running_statistics(lambda: resnet_cifar(8)), (32, 3, 32, 32)),
    "resnet20": (_with_running_statistics(lambda: resnet_cifar(20)), (32, 3, 32, 32)),
}

METHODS = ("gradient", "backpack", "backpack_mc", "normflat_ggn", "normflat_ggn_mc")
#: The BackPACK extension of each BackPACK method and the parameter attribute it fills.
BACKPACK = {"backpack": ("DiagGGNExact", {}, "diag_ggn_exact"), "backpack_mc": ("DiagGGNMC", {"mc_samples": 1}, "diag_ggn_mc")}


def make_problem(name: str, device: str = "cpu", seed: int = 0):
    """Model (eval mode, float32) and one batch ``(x, y)`` of the named problem."""
    factory, shape = PROBLEMS[name]
    torch.manual_seed(seed)
    model = factory().to(device).eval()
    x = torch.randn(*shape, device=device)
    y = torch.randint(0, 10, (shape[0],), device=device)
    return model, x, y


def _runner(method: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    if method == "gradient":
        loss_fn = nn.CrossEntropyLoss()

        def run():
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            return [p.grad for p in model.parameters()]
        return run
    if method in BACKPACK:
        from backpack import backpack, extend, extensions

        extension, settings, attribute = BACKPACK[method]
        make_extension = getattr(extensions, extension)

        # A residual forward's additions are functions, not modules: BackPACK's converter traces the
        # model into one whose every operation is a module it can extend.
        residual = any(isinstance(m, _BasicBlock) for m in model.modules())
        bp_model = extend(copy.deepcopy(model), use_converter=residual)
        loss_fn = extend(nn.CrossEntropyLoss())

        def run():
            bp_model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                # BackPACK's hooks trigger this torch warning on every call; it is harmless here.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                with backpack(make_extension(**settings)):
                    loss_fn(bp_model(x), y).backward()
            # Keyed by layer, as normflat's diagonals are.
            return {name.removesuffix(".weight"): getattr(p, attribute) for name, p in bp_model.named_parameters()
                    if name.endswith("weight")}
        return run
    estimator = {"normflat_ggn": "ggn", "normflat_ggn_mc": "ggn-mc"}[method]

    def run():
        return normflat.hessian_diagonal(model, (x, y), loss="ce", estimator=estimator, progress=False)
    return run


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_interleaved(runs: dict[str, Callable[[], Any]], repeats: int, device: str) -> dict[str, float]:
    """Median seconds per method; the methods alternate within each round so that load
    from other processes affects them alike."""
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(repeats):
        for m, run in runs.items():
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(t) for m, t in times.items()}


def _peak_worker(problem: str, method: str, device: str, queue) -> None:
    model, x, y = make_problem(problem, device)
    run = _runner(method, model, x, y)
    run()  # warm-up: one-time imports and initialization are not part of the peak
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        queue.put((torch.cuda.max_memory_allocated() - base) / 2**20)
        return
    # Linux: reset the peak-RSS mark (VmHWM) so the peak of this one run is measured.
    try:
        before = reset_peak_kib()
        run()
        queue.put((proc_status_kib("VmHWM") - before) / 1024)
    except OSError:  # not Linux: the process-wide high-water mark (includes start-up)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)


def _peak_mib(problem: str, method: str, device: str) -> float:
    return value_from_fresh_process(_peak_worker, (problem, method, device), timeout=600)


def _rel_error(estimate: dict, exact: dict) -> float:
    """``‖estimate − exact‖ / ‖exact‖`` over all weights (the same names, torch layouts)."""
    num = sum(float((estimate[k].to(v) - v).square().sum()) for k, v in exact.items())
    return (num / sum(float(v.square().sum()) for v in exact.values())) ** 0.5


#: One-sample estimates averaged for the error column (a single draw's error varies by a factor of two).
MC_DRAWS = 5


def _mc_errors(model: nn.Module, x: torch.Tensor, y: torch.Tensor, exact: dict) -> dict[str, float]:
    """The mean over :data:`MC_DRAWS` draws of each one-sample estimate's :func:`_rel_error`
    (normflat's draws from its ``seed``, BackPACK's from the global generator, seeded here)."""
    backpack_mc = _runner("backpack_mc", model, x, y)
    ours, theirs = [], []
    for seed in range(MC_DRAWS):
        ours.append(_rel_error(dict(normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn-mc",
                                                               seed=seed, progress=False)), exact))
        torch.manual_seed(seed)
        theirs.append(_rel_error(backpack_mc(), exact))
    return {"normflat_ggn_mc": statistics.mean(ours), "backpack_mc": statistics.mean(theirs)}


def _max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for name, da in a.items():
        db = b[name].to(da)
        worst = max(worst, float((da - db).abs().max() / db.abs().max().clamp_min(1e-30)))
    return worst


def torch_figures(repeats: int = 5, device: str = "cpu", memory: bool = True,
                  problems: tuple[str, ...] = tuple(PROBLEMS)) -> dict[str, dict[str, Any]]:
    """Measure every method on every problem.

    Returns:
        ``{problem: {"seconds": {method: s}, "x_gradient": {method: multiple of one
        gradient}, "ratio_vs_backpack": {"normflat_ggn": r, "normflat_ggn_mc": r},
        "peak_mib": {method: MiB} (if memory), "max_rel_diff_ggn_vs_backpack": d}}``.
        BackPACK figures are ``None`` when it is not installed.
    """
    try:
        import backpack  # noqa: F401
        have_backpack = True
    except ImportError:
        have_backpack = False
    methods = [m for m in METHODS if have_backpack or m not in BACKPACK]
    out: dict[str, dict[str, Any]] = {}
    for name in problems:
        model, x, y = make_problem(name, device)
        seconds = _time_interleaved({m: _runner(m, model, x, y) for m in methods}, repeats, device)
        fig: dict[str, Any] = {"seconds": seconds,
                               "x_gradient": {m: seconds[m] / seconds["gradient"] for m in methods}}
        if have_backpack:
            fig["ratio_vs_backpack"] = {"normflat_ggn": seconds["normflat_ggn"] / seconds["backpack"],
                                        "normflat_ggn_mc": seconds["normflat_ggn_mc"] / seconds["backpack_mc"]}
            ours = _runner("normflat_ggn", model, x, y)()
            theirs = _runner("backpack", model, x, y)()
            fig["max_rel_diff_ggn_vs_backpack"] = _max_rel_diff(dict(ours), theirs)
            fig["mc_rel_error"] = _mc_errors(model, x, y, ours)
        else:
            fig["ratio_vs_backpack"] = None
            fig["max_rel_diff_ggn_vs_backpack"] = None
        if memory:
            fig["peak_mib"] = {m: _peak_mib(name, m, device) for m in methods}
        out[name] = fig
    return out


def format_figures(figs: dict[str, dict[str, Any]]) -> str:
    """A plain-text table of :func:`torch_figures`' result."""
    lines = []
    for name, fig in figs.items():
        lines.append(f"{name}:")
        lines.append(f"  {'method':<18}{'median s':>11}{'x gradient':>12}{'peak MiB':>10}")
        for m, s in fig["seconds"].items():
            mem = fig.get("peak_mib", {}).get(m)
            mem_s = f"{mem:10.1f}" if mem is not None else f"{'-':>10}"
            lines.append(f"  {m:<18}{s:11.4f}{fig['x_gradient'][m]:12.2f}{mem_s}")
        if fig["ratio_vs_backpack"]:
            r = fig["ratio_vs_backpack"]
            diff = fig["max_rel_diff_ggn_vs_backpack"]
            lines.append(f"  normflat/BackPACK: ggn {r['normflat_ggn']:.2f}x (DiagGGNExact), ggn-mc "
                         f"{r['normflat_ggn_mc']:.2f}x (DiagGGNMC); max relative difference of the exact diagonals "
                         f"{diff:.1e} ({'equal to 1e-5' if diff <= 1e-5 else 'MISMATCH above 1e-5'})")
            err = fig["mc_rel_error"]
            lines.append(f"  one-sample error against the exact diagonal (mean of {MC_DRAWS} draws): normflat ggn-mc "
                         f"{err['normflat_ggn_mc']:.0%}, BackPACK DiagGGNMC {err['backpack_mc']:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS), choices=list(PROBLEMS))
    args = parser.parse_args(argv)
    figs = torch_figures(args.repeats, args.device, memory=not args.no_memory, problems=tuple(args.problems))
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    print(format_figures(figs))


if __name__ == "__main__":
    main()
