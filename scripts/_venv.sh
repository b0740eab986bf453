# Sourced by scripts/main and scripts/test: create or update the project's venv.
# Idempotent: reinstalls only when pyproject.toml or requirements-ci.txt changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NORMFLAT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "normflat: creating virtual environment in $VENV"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.normflat-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/requirements-ci.txt" "$ROOT/requirements-nodeps.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    # The frameworks take about 7.5 GB in the venv (torch 2.14.1 is a CUDA build) and pip unpacks
    # them beside it: say so at once rather than fail half-way with "No space left on device".
    FREE_KB="$(df -Pk "$VENV" | awk 'NR==2 {print $4}')"
    if [ "${FREE_KB:-0}" -lt $((10 * 1024 * 1024)) ]; then
        echo "normflat: only $((FREE_KB / 1024)) MiB free on the disk of $VENV; installing the frameworks needs about 10 GiB (free some space, or set NORMFLAT_VENV to a venv on another disk)" >&2
        exit 1
    fi
    echo "normflat: installing normflat[dev] with the pinned CPU frameworks (requirements-ci.txt); takes ~2 minutes the first time"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev]" -r "$ROOT/requirements-ci.txt" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$ROOT/requirements-nodeps.txt" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    # The CUDA build of torch 2.14.1 pulls in triton, a GPU kernel compiler that segfaults on
    # import once TensorFlow is loaded (torch.func imports torch._dynamo, which imports it). These
    # machines have no GPU and torch treats triton as optional: remove it.
    "$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y triton >/dev/null 2>&1 || true
    "$VENV/bin/python" -c "import normflat, torch, torchvision, timm, transformers, peft, tensorflow, keras, keras_hub, jax, flax, equinox" \
        || { echo "normflat: installation failed" >&2; exit 1; }
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
export NO_MKDOCS_2_WARNING=1
cd "$ROOT"
