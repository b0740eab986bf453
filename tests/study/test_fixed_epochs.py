"""``--fixed-epochs``: every model trains for exactly ``epochs`` epochs (the paper's §6.2)."""

from __future__ import annotations

from tests.builders import require_frameworks

require_frameworks("torch")

from normflat.cli import build_parser  # noqa: E402
from normflat.study.run import StudyConfig, format_table, run_study  # noqa: E402


def _study(tmp_path, name, **kwargs):
    config = StudyConfig(train_size=60, test_size=40, epochs=3, target_accuracy=0.05, ratios=(0.0,), seeds=(0,),
                         rivals=(), reparam=False, progress=False, out=str(tmp_path / name), **kwargs)
    return run_study(config, echo=None)


def test_fixed_epochs_trains_past_the_target(tmp_path):
    early = _study(tmp_path, "early")
    fixed = _study(tmp_path, "fixed", fixed_epochs=True)
    assert early.rows[0]["epochs"] == 1  # 5 % training accuracy is reached after one epoch
    assert fixed.rows[0]["epochs"] == 3 and fixed.rows[0]["fitted"]
    assert fixed.config["fixed_epochs"] is True
    assert "every model trained 3 epochs" in format_table(fixed)
    args = build_parser().parse_args(["study", "--fixed-epochs", "--epochs", "7"])
    assert args.fixed_epochs and args.epochs == 7
