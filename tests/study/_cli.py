"""Running ``normflat`` in-process in the study tests, and checking its one-line errors."""

from __future__ import annotations

from normflat.cli import main


def run_cli(argv, capsys):
    """Exit status, stdout and stderr of ``normflat ARGV`` run in-process."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, *fragments, framework_logs=False):
    """Exit status 2 and one ``normflat: error: ...`` line holding every fragment, no traceback.

    Args:
        framework_logs: Only count the lines normflat wrote (``normflat: ...``): TensorFlow and
            JAX write their own log lines to stderr.
    """
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()
             and (not framework_logs or line.startswith("normflat: "))]
    assert len(lines) == 1 and "Traceback" not in err, err
    if not framework_logs:
        assert lines[0].startswith("normflat: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
