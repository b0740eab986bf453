"""Benchmark: normflat's GGN diagonal in JAX against one gradient, next to PyTorch.

Same problems as ``benchmarks/torch_diag.py`` (float32, random data, 10 classes):

* ``mlp``: 784-512-256-10 ReLU MLP, batch 128;
* ``3c3d``: the DeepOBS 3C3D CIFAR-10 CNN, batch 32.

JAX models are flax nnx modules (NHWC). Methods: one jit-compiled gradient of the
mean cross-entropy (``jax.grad``), normflat ``estimator="ggn"`` and ``"ggn-mc"``
(one sample), all with ``loss="ce"``. normflat is timed end to end, as a user
calls it (``normflat.hessian_diagonal(model, (x, y), ...)``: tracing the model,
cache look-up of the compiled estimator, computation). Times are medians of
``repeats`` runs after one warm-up run (which compiles), methods alternating
within each round. The PyTorch figures come from
:func:`benchmarks.torch_diag.torch_figures` in the same process, run first.

``--position-table`` times instead a tiny ViT (class token, a learned ``(1, 17, 64)``
position table added to 16 patch embeddings, one MLP block, batch 32): ``ggn`` with
the table on its fast rule (method §6.1 "Position tables") and on the generic path
(:func:`position_table_figures`).

``--tied-lm`` times a tiny language model whose head is its token embedding (an nnx
``Embed`` of 1000 ids and 64 features read by the lookup and by ``attend``, one causal
attention block and one MLP block, 16 sequences of 16 tokens): ``ggn-topk`` per
sequence (``auto`` for token logits) with the table on its fast rule (method §6.1
"Tied weights") and on the generic path (:func:`tied_lm_figures`).

``--shared K`` times a model whose one ``nnx.Linear`` (128 → 128) is called ``K`` times per forward
(a residual ``tanh`` block applied in a Python loop, ALBERT-style; 32 sequences of 16 tokens, 10
classes): one gradient, ``ggn`` with the shared weight on its fast rule (one tap per call, method
§6.1 "Tied weights") and on the generic path (:func:`shared_layer_figures`).

``--many-classes C`` measures instead the peak memory and time of the exact ``ggn`` of
3C3D with ``C`` classes on 8 images against a training step (the gradient and a momentum
update), each in a fresh process after a warm-up run that compiles
(:func:`many_classes_figures`): one example's ``C − 1`` signals go a few at a time when
they alone exceed the default budget. ``--sequence-lm V`` does the same for ``ggn-topk``
(per sequence) on a small language model with token logits over a vocabulary of ``V``
(:func:`sequence_lm_figures`), also under two memory budgets.

Run::

    python -m benchmarks.jax_diag [--repeats 5] [--no-torch]
    python -m benchmarks.jax_diag --many-classes 1000
    python -m benchmarks.jax_diag --sequence-lm 8000
    python -m benchmarks.jax_diag --position-table [--repeats 5]
    python -m benchmarks.jax_diag --tied-lm [--repeats 5]
    python -m benchmarks.jax_diag --shared 8 [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

import normflat
from benchmarks._common import time_interleaved  # noqa: E402

__all__ = ["mlp", "cnn_3c3d", "PROBLEMS", "make_problem", "jax_figures", "position_table_figures", "tied_lm_figures",
           "shared_layer_figures", "many_classes_figures", "sequence_lm_figures", "main"]


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(784, 512, rngs=rngs)
        self.l2 = nnx.Linear(512, 256, rngs=rngs)
        self.l3 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def _pool(x):
    # torch MaxPool2d(3, stride=2, padding=1)
    return nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class _C3D3(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, classes: int = 10):
        self.c1 = nnx.Conv(3, 64, (5, 5), padding="VALID", rngs=rngs)
        self.c2 = nnx.Conv(64, 96, (3, 3), padding="VALID", rngs=rngs)
        self.c3 = nnx.Conv(96, 128, (3, 3), padding=1, rngs=rngs)
        self.d1 = nnx.Linear(1152, 512, rngs=rngs)
        self.d2 = nnx.Linear(512, 256, rngs=rngs)
        self.d3 = nnx.Linear(256, classes, rngs=rngs)

    def __call__(self, x):
        x = _pool(nnx.relu(self.c1(x)))
        x = _pool(nnx.relu(self.c2(x)))
        x = _pool(nnx.relu(self.c3(x)))
        x = x.reshape(x.shape[0], -1)
        return self.d3(nnx.relu(self.d2(nnx.relu(self.d1(x)))))


def mlp(seed: int = 0) -> nnx.Module:
    """784-512-256-10 ReLU MLP on flattened 28x28 images."""
    return _MLP(nnx.Rngs(seed))


def cnn_3c3d(seed: int = 0, classes: int = 10) -> nnx.Module:
    """DeepOBS 3C3D CIFAR-10 network, NHWC (``classes`` outputs)."""
    return _C3D3(nnx.Rngs(seed), classes)


#: name -> (model factory, input shape with batch axis, NHWC)
PROBLEMS: dict[str, tuple[Callable[[], nnx.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (128, 28, 28, 1)),
    "3c3d": (cnn_3c3d, (32, 32, 32, 3)),
}
METHODS = ("gradient", "normflat_ggn", "normflat_ggn_mc")


def make_problem(name: str, seed: int = 0):
    """Model (float32) and one batch ``(x, y)`` of the named problem."""
    factory, shape = PROBLEMS[name]
    model = factory(seed)
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, shape, jnp.float32)
    y = jax.random.randint(ky, (shape[0],), 0, 10)
    return model, x, y


def _runner(method: str, model, x, y) -> Callable[[], Any]:
    if method == "gradient":
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def grad(params, x, y):
            def loss(p):
                logits = nnx.merge(graphdef, p, rest)(x)
                return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])
            return jax.grad(loss)(params)

        return lambda: jax.block_until_ready(grad(params, x, y))
    estimator = {"normflat_ggn": "ggn", "normflat_ggn_mc": "ggn-mc"}[method]
    return lambda: jax.block_until_ready(
        normflat.hessian_diagonal(model, (x, y), loss="ce", estimator=estimator, progress=False))


def jax_figures(repeats: int = 5, problems: tuple[str, ...] = tuple(PROBLEMS)) -> dict[str, dict[str, Any]]:
    """``{problem: {"seconds": {method: s}, "x_gradient": {method: multiple of one gradient}}}``."""
    out = {}
    for name in problems:
        model, x, y = make_problem(name)
        seconds = time_interleaved({m: _runner(m, model, x, y) for m in METHODS}, repeats)
        out[name] = {"seconds": seconds, "x_gradient": {m: seconds[m] / seconds["gradient"] for m in METHODS}}
    return out


class _TinyViT(nnx.Module):
    """16 patches of 48 features -> Dense 64, a class token, a (1, 17, 64) position table, one
    residual MLP block (128 hidden units), the class token's head (10 classes)."""

    def __init__(self, rngs: nnx.Rngs):
        self.patch = nnx.Linear(48, 64, rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, 64)))
        self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, 17, 64)))
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)
        self.head = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        h = self.patch(x)
        h = jnp.concatenate([jnp.broadcast_to(self.cls_token[...], (h.shape[0], 1, 64)), h], axis=1)
        h = h + self.pos_embed[:, :h.shape[1]]
        h = h + self.down(nnx.gelu(self.up(h)))
        return self.head(h[:, 0])


def position_table_figures(repeats: int = 5) -> dict[str, float]:
    """Seconds of ``ggn`` on :class:`_TinyViT` (batch 32) with the position table on its fast rule
    and on the generic path, and their ratio.

    The generic path is the same analysis traced without the added-table taps
    (``program._TABLE_ADD`` emptied, the trace and kernel caches cleared, as the tests do).
    """
    model = _TinyViT(nnx.Rngs(0))
    kx, ky = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(kx, (32, 16, 48), jnp.float32), jax.random.randint(ky, (32,), 0, 10)

    def ggn():
        return jax.block_until_ready(normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn",
                                                               progress=False))

    fast = time_interleaved({"fast": ggn}, repeats)["fast"]
    with _without_taps("_TABLE_ADD"):
        generic = time_interleaved({"generic": ggn}, repeats)["generic"]
    return {"fast": fast, "generic": generic, "generic_over_fast": generic / fast}


@contextlib.contextmanager
def _without_taps(kind: str) -> Iterator[None]:
    """Analyses traced without one kind of tap (``program.<kind>`` emptied: those weights take the
    generic path), the trace and kernel caches cleared on the way in and out, as the tests do."""
    from normflat.backends.jax import program, session

    saved = getattr(program, kind)
    session._TRACES.clear()
    session._CACHE.clear()
    setattr(program, kind, frozenset())
    try:
        yield
    finally:
        setattr(program, kind, saved)
        session._TRACES.clear()
        session._CACHE.clear()


class _TinyTiedLM(nnx.Module):
    """Ids (16 tokens) -> an ``Embed`` (1000 ids, 64 features) -> a causal 2-head attention block and
    an MLP block (128 hidden units), each residual -> ``attend``, the head tied to the table."""

    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(1000, 64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 64, decode=False, rngs=rngs)
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        h = h + self.attn(h, mask=nnx.make_causal_mask(ids))
        h = h + self.down(nnx.gelu(self.up(h)))
        return self.emb.attend(h)


def tied_lm_figures(repeats: int = 5) -> dict[str, float]:
    """Seconds of ``ggn-topk`` (per sequence) on :class:`_TinyTiedLM` (16 sequences) with the table on
    its fast rule and on the generic path, the other layers fast in both, and their ratio.

    The generic path is the same analysis traced without the tied taps (``program._TIED_USES``
    emptied, the trace and kernel caches cleared, as the tests do).
    """
    model = _TinyTiedLM(nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (16, 16), 0, 1000)
    data = (ids, jnp.concatenate([ids[:, 1:], jnp.full((16, 1), -100)], axis=1))

    def ggn_topk():
        return jax.block_until_ready(normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn-topk",
                                                               progress=False))

    def path():
        report = normflat.analyze(model, data, loss="ce", estimator="ggn-topk", progress=False)
        return report.layer("emb").details["path"]

    assert path() == "fast"
    fast = time_interleaved({"fast": ggn_topk}, repeats)["fast"]
    with _without_taps("_TIED_USES"):
        assert path() == "generic"
        generic = time_interleaved({"generic": ggn_topk}, repeats)["generic"]
    return {"fast": fast, "generic": generic, "generic_over_fast": generic / fast}


class _SharedBlock(nnx.Module):
    """Features (32) -> ``Linear`` 128 -> ``calls`` times ``h + tanh(shared(h))`` with one ``Linear``
    (128 → 128) -> the mean over the tokens -> a 10-class head."""

    def __init__(self, rngs: nnx.Rngs, calls: int):
        self.calls = calls
        self.inp = nnx.Linear(32, 128, rngs=rngs)
        self.shared = nnx.Linear(128, 128, rngs=rngs)
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        for _ in range(self.calls):
            h = h + jnp.tanh(self.shared(h))
        return self.head(h.mean(1))


def shared_layer_figures(calls: int = 8, repeats: int = 5) -> dict[str, float]:
    """Seconds of one gradient and of ``ggn`` on :class:`_SharedBlock` (32 sequences of 16 tokens) with
    the shared weight on its fast rule and on the generic path (traced without the tied taps)."""
    model = _SharedBlock(nnx.Rngs(0), calls)
    x = jax.random.normal(jax.random.key(0), (32, 16, 32))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 10)

    def ggn():
        return jax.block_until_ready(normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn",
                                                               progress=False))

    def path():
        return normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False).layer("shared").details["path"]

    assert path() == "fast"
    fast = time_interleaved({"gradient": _runner("gradient", model, x, y), "fast": ggn}, repeats)
    with _without_taps("_TIED_USES"):
        assert path() == "generic"
        generic = time_interleaved({"gradient": _runner("gradient", model, x, y), "generic": ggn}, repeats)
    return {"gradient": min(fast["gradient"], generic["gradient"]), "fast": fast["fast"], "generic": generic["generic"]}


class _SequenceLM(nnx.Module):
    """Ids -> an ``Embed`` (``vocabulary`` ids, 64 features) -> a residual MLP block (128 hidden
    units) -> a dense head: token logits ``(n, T, vocabulary)``."""

    def __init__(self, rngs: nnx.Rngs, vocabulary: int = 8000):
        self.emb = nnx.Embed(vocabulary, 64, rngs=rngs)
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)
        self.head = nnx.Linear(64, vocabulary, rngs=rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        h = h + self.down(nnx.gelu(self.up(h)))
        return self.head(h)


def _peak_problem(problem: str, size: int, n: int):
    """``(model, x, y, estimator, mean loss)`` of :func:`_peak_worker`'s problems."""
    if problem == "3c3d":
        model = cnn_3c3d(0, size)
        x = jax.random.normal(jax.random.key(1), (n, 32, 32, 3), jnp.float32)
        y = jax.random.randint(jax.random.key(2), (n,), 0, size)

        def loss(z):
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1))
        return model, x, y, "ggn", loss
    model = _SequenceLM(nnx.Rngs(0), size)
    x = jax.random.randint(jax.random.key(1), (n, 64), 0, size)
    y = jnp.concatenate([x[:, 1:], jnp.full((n, 1), -100)], axis=1)  # the next token; the last one ignored

    def loss(z):
        counted = y >= 0
        picked = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.maximum(y, 0)[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(counted, picked, 0.0)) / jnp.sum(counted)
    return model, x, y, "ggn-topk", loss


def _peak_worker(problem: str, method: str, size: int, n: int, budget: str | None, queue) -> None:
    """In a fresh process: peak resident memory (MiB) that two runs of ``method`` add after a
    warm-up run (which compiles), and the seconds of one run."""
    import gc
    import time

    from benchmarks._common import proc_status_kib, reset_peak_kib

    model, x, y, estimator, mean_loss = _peak_problem(problem, size, n)
    if method == "training step":  # the gradient and a momentum update of every parameter
        graphdef, params = nnx.split(model)

        @jax.jit
        def step(params, momentum):
            def loss(p):
                return mean_loss(nnx.merge(graphdef, p)(x))

            grads = jax.grad(loss)(params)
            momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
            return jax.tree_util.tree_map(lambda p, m: p - 1e-3 * m, params, momentum), momentum

        momentum = jax.tree_util.tree_map(jnp.zeros_like, params)

        def run():
            return jax.block_until_ready(step(params, momentum))
    else:
        extra = {} if budget is None else {"memory_budget": budget}

        def run():
            return jax.block_until_ready(normflat.hessian_diagonal(model, (x, y), loss="ce", estimator=estimator,
                                                                   progress=False, **extra))
    try:
        run()
    except ValueError as refused:  # a memory_budget too small: reported, not waited for
        queue.put(str(refused).split(":")[0])
        return
    gc.collect()
    before = reset_peak_kib()
    start = time.perf_counter()
    run()
    run()
    seconds = (time.perf_counter() - start) / 2
    queue.put(((proc_status_kib("VmHWM") - before) / 1024, seconds))


def _peak_figures(problem: str, size: int, n: int, budgets: tuple[str | None, ...] = (None,)
                  ) -> dict[str, tuple[float, float] | str]:
    """``{method: (peak MiB, seconds)}`` of a training step and normflat (each ``budgets`` entry),
    each in a fresh process (Linux: ``/proc`` peak marks); a refused budget: its message's start."""
    import multiprocessing as mp

    from benchmarks._common import mmap_freed_blocks

    out = {}
    runs = [("training step", None)] + [("normflat", budget) for budget in budgets]
    for method, budget in runs:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_peak_worker, args=(problem, method, size, n, budget, queue))
        with mmap_freed_blocks():
            proc.start()
        out[method if budget is None else f"memory_budget={budget}"] = queue.get(timeout=3600)
        proc.join()
    return out


def many_classes_figures(classes: int = 1000, n: int = 8) -> dict[str, tuple[float, float]]:
    """``{method: (peak MiB, seconds)}`` of a training step and the exact ``ggn`` of 3C3D with
    ``classes`` outputs on ``n`` images, each in a fresh process (Linux: ``/proc`` peak marks)."""
    figs = _peak_figures("3c3d", classes, n)
    return {"training step": figs["training step"], "ggn": figs["normflat"]}


def sequence_lm_figures(vocabulary: int = 8000, n: int = 4, budgets: tuple[str | None, ...] = (None, "40MB", "16MB")
                        ) -> dict[str, tuple[float, float] | str]:
    """``{method: (peak MiB, seconds)}`` of a training step and ``ggn-topk`` (per sequence, the
    default for token logits) of :class:`_SequenceLM` on ``n`` sequences of 64 tokens, without
    options and under each ``memory_budget``, each in a fresh process."""
    return _peak_figures("lm", vocabulary, n, budgets)


def format_side_by_side(jax_figs: dict, torch_figs: dict | None) -> str:
    """Plain-text table: JAX seconds and multiples, PyTorch multiples, and their ratio for ggn."""
    lines = []
    for name, fig in jax_figs.items():
        lines.append(f"{name}:")
        lines.append(f"  {'method':<18}{'JAX s':>10}{'JAX x grad':>12}{'torch x grad':>14}")
        tf = (torch_figs or {}).get(name)
        for m in METHODS:
            t = tf["x_gradient"].get(m) if tf else None
            t_s = f"{t:14.2f}" if t is not None else f"{'-':>14}"
            lines.append(f"  {m:<18}{fig['seconds'][m]:10.4f}{fig['x_gradient'][m]:12.2f}{t_s}")
        if tf:
            r = fig["x_gradient"]["normflat_ggn"] / tf["x_gradient"]["normflat_ggn"]
            lines.append(f"  JAX ggn multiple / torch ggn multiple: {r:.2f} (target <= 1.5)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch figures")
    parser.add_argument("--problems", nargs="*", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--position-table", action="store_true",
                        help="time a tiny ViT's position table: fast rule against the generic path")
    parser.add_argument("--tied-lm", action="store_true",
                        help="time a tiny LM's table tied to its head: fast rule against the generic path")
    parser.add_argument("--many-classes", type=int, default=None, metavar="C",
                        help="peak memory and time of the exact ggn of 3C3D with C classes (8 images) against a "
                             "training step, in fresh processes")
    parser.add_argument("--sequence-lm", type=int, default=None, metavar="V",
                        help="peak memory and time of ggn-topk (per sequence) on a small LM with a vocabulary of V "
                             "(4 sequences of 64 tokens) against a training step, without options and under "
                             "memory budgets of 40 and 16 MB, in fresh processes")
    parser.add_argument("--shared", type=int, default=None, metavar="K",
                        help="time ggn on a model whose one Linear is called K times per forward: fast rule "
                             "against the generic path, against one gradient")
    args = parser.parse_args(argv)
    if args.shared:
        f = shared_layer_figures(args.shared, args.repeats)
        print(f"jax {jax.__version__}, device {jax.devices()[0]}, one Linear (128 -> 128) called {args.shared} times "
              f"(32 sequences of 16 tokens), ggn, median of {args.repeats}")
        print(f"  gradient {f['gradient'] * 1e3:.1f} ms; shared weight fast {f['fast'] / f['gradient']:.1f}x, "
              f"generic {f['generic'] / f['gradient']:.1f}x a gradient")
        return
    if args.sequence_lm:
        f = sequence_lm_figures(args.sequence_lm)
        step_mib, step_s = f.pop("training step")
        print(f"jax {jax.__version__}, device {jax.devices()[0]}, LM with a vocabulary of {args.sequence_lm}, "
              "4 sequences of 64 tokens, ggn-topk per sequence")
        print(f"  training step: peak {step_mib:.1f} MiB, {step_s:.3f} s")
        for name, got in f.items():
            if isinstance(got, str):
                print(f"  {name + ':':<24} refused ({got})")
                continue
            mib, sec = got
            print(f"  {name + ':':<24} peak {mib:.1f} MiB ({mib / step_mib:.2f}x a training step), {sec:.3f} s")
        return
    if args.many_classes:
        f = many_classes_figures(args.many_classes)
        step_mib, step_s = f["training step"]
        ggn_mib, ggn_s = f["ggn"]
        print(f"jax {jax.__version__}, device {jax.devices()[0]}, 3C3D with {args.many_classes} classes, 8 images")
        print(f"  training step: peak {step_mib:.1f} MiB, {step_s:.3f} s")
        print(f"  ggn:           peak {ggn_mib:.1f} MiB ({ggn_mib / step_mib:.2f}x a training step, at least "
              f"32 MiB by default), {ggn_s:.2f} s")
        return
    if args.position_table:
        f = position_table_figures(args.repeats)
        print(f"jax {jax.__version__}, device {jax.devices()[0]}, tiny ViT (batch 32, 17 tokens, d 64), ggn, "
              f"median of {args.repeats}")
        print(f"  position table fast {f['fast']:.4f} s, generic {f['generic']:.4f} s, "
              f"generic / fast {f['generic_over_fast']:.2f}")
        return
    if args.tied_lm:
        f = tied_lm_figures(args.repeats)
        print(f"jax {jax.__version__}, device {jax.devices()[0]}, tiny tied LM (16 sequences of 16 tokens, "
              f"vocabulary 1000, d 64), ggn-topk, median of {args.repeats}")
        print(f"  tied table fast {f['fast']:.4f} s, generic {f['generic']:.4f} s, "
              f"generic / fast {f['generic_over_fast']:.2f}")
        return
    torch_figs = None
    if not args.no_torch:
        from benchmarks.torch_diag import torch_figures

        torch_figs = torch_figures(args.repeats, "cpu", memory=False, problems=tuple(args.problems))
    figs = jax_figures(args.repeats, tuple(args.problems))
    print(f"jax {jax.__version__}, device {jax.devices()[0]}, normflat {normflat.__version__}")
    print(format_side_by_side(figs, torch_figs))


if __name__ == "__main__":
    main()
