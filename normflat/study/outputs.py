"""Output folders that never mix two runs: stage, then replace the previous run's files.

``normflat study`` and ``normflat invariance`` write every file of a run into a
staging folder inside ``--out`` first. Only when the run has finished are the
previous run's files removed (those listed in the folder's manifest,
``normflat-manifest.json``, or, for folders written before manifests existed, the
file names the command writes) and the new files moved in, with a new manifest.
So

- a run that fails or is interrupted leaves the previous results as they were
  (its staging folder ``.normflat-partial-*`` is removed, or by the next run);
- a finished run leaves exactly its own files: a 1-model study after a 3-model
  study leaves no ``run001*``;
- files in ``--out`` that normflat did not write are left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["MANIFEST", "OutputFolderError", "check_output_folder", "replace_outputs"]

#: File that lists, relative to the folder, every file the last run wrote there.
MANIFEST = "normflat-manifest.json"
_MANIFEST_SCHEMA = "normflat.outputs/1"
_PARTIAL = ".normflat-partial-"


class OutputFolderError(ValueError):
    """The output folder cannot be used (it is a file, or its manifest is unreadable)."""


def check_output_folder(out: str | os.PathLike) -> Path:
    """Check that ``out`` is a folder or can become one, before any work is done.

    Raises:
        OutputFolderError: If ``out`` (or a folder above it) is an existing file.
    """
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            what = "it" if p == path else f"{p} (above it)"
            raise OutputFolderError(
                f"The output folder {path} cannot be created: {what} is a file. Pass a folder "
                "(it is created if missing) or remove the file."
            )
        if p.exists():
            break
    return path


def _previous_files(out: Path, legacy: Sequence[str]) -> list[Path]:
    manifest = out / MANIFEST
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            names = [str(n) for n in data["files"]]
        except (ValueError, KeyError, TypeError) as err:
            raise OutputFolderError(
                f"{manifest} is not a readable normflat manifest ({err}); delete it (and the old "
                "results beside it) and run again."
            ) from None
    else:  # written before manifests: the names this command writes
        names = [str(p.relative_to(out)) for pattern in legacy for p in out.glob(pattern) if p.is_file()]
    files = []
    for name in names:
        p = (out / name)
        # A manifest names files inside the folder only; never follow one outside.
        if p.resolve().is_relative_to(out.resolve()) and p.is_file():
            files.append(p)
    return files


@contextlib.contextmanager
def replace_outputs(out: str | os.PathLike, *, legacy: Sequence[str] = ()) -> Iterator[Path]:
    """Stage a run's files, then swap them in for the previous run's on success.

    Args:
        out: The output folder (created if missing).
        legacy: Glob patterns, relative to ``out``, of the files a run of this command
            wrote before manifests existed (removed when there is no manifest).

    Yields:
        The staging folder to write every file of the run into, with the same
        relative paths they should have in ``out``.

    Raises:
        OutputFolderError: If ``out`` is a file or its manifest is unreadable.
    """
    out = check_output_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(_PARTIAL + "*"):  # left by a run that was killed
        shutil.rmtree(stale, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=out))
    try:
        yield stage
        previous = _previous_files(out, legacy)
        new = sorted(p.relative_to(stage) for p in stage.rglob("*") if p.is_file())
        for p in previous:
            p.unlink()
        for folder in sorted({p.parent for p in previous}, key=lambda p: len(p.parts), reverse=True):
            if folder != out and not any(folder.iterdir()):
                folder.rmdir()  # e.g. reports/ emptied of the previous run's reports
        for rel in new:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / rel, out / rel)
        manifest = {"schema": _MANIFEST_SCHEMA, "files": [p.as_posix() for p in new]}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
