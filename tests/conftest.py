import os

# Keep framework start-up quiet in tests. TensorFlow keeps its default oneDNN kernels, which
# users run with: turned off here they had hidden a segmentation fault of its vectorized per-sample
# gradients (docs/guide/keras.md); the whole suite passes with them (set TF_ENABLE_ONEDNN_OPTS=0
# to run it without).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
# Under pytest-xdist every worker gets its share of the cores: the frameworks' own thread pools
# (OpenMP for torch, Eigen for XLA, TensorFlow's intra-op pool) would otherwise each take all
# of them, and two workers on two cores spend their time switching (about 20 % of the suite).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if os.environ.get("PYTEST_XDIST_WORKER") and _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
        os.environ.setdefault(_name, _THREADS)
    if _THREADS == "1" and "multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
# XLA's persistent compilation cache, in the user's cache folder (shared by the xdist workers and
# by every checkout on the machine, so that a fresh clone's run, as CI's, starts from the last
# run's programs): the JAX tests rebuild the same small models again and again, and compiling
# their programs is most of their time (the suite: about 1840 s of test time with an empty cache,
# 1250 s with a warm one, on 2 cores). A hit is the executable XLA compiled for the same program,
# options and versions: the numbers are the same; a miss only compiles. It grows by the programs
# of new code only (80 MB after weeks of it) and may be deleted at any time: JAX's size bound is
# left off, since it reads every entry's access time on every write (a cold run's thousands of
# writes would each scan thousands of files). NORMFLAT_TEST_JAX_CACHE moves it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ.get("NORMFLAT_TEST_JAX_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "normflat", "tests", "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
