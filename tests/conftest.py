import os

# Keep framework start-up quiet and deterministic in tests.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
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
