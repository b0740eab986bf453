"""The layer registry and the skipped-layer report of :mod:`normflat.engine.registry`."""

from __future__ import annotations

import os
import warnings

import pytest

import normflat.engine.registry as registry_module
from normflat.engine import IGNORE, LayerRegistry, Skipped, Unsupported, warn_user


class Base:
    pass


class Dense(Base):
    pass


class MyDense(Dense):
    pass


class Conv(Base):
    pass


class Norm(Base):
    pass


class Odd(Base):
    pass


def _registry():
    reg = LayerRegistry("testfw", Base, "normflat.testfw.register_layer(cls, extractor)")
    reg.register(Dense, "dense-extractor")
    reg.register(Conv, "conv-extractor")
    reg.register(Norm, IGNORE)
    reg.register(Odd, Unsupported("odd layers share weights across time"))
    return reg


def test_lookup_walks_the_mro():
    reg = _registry()
    assert reg.lookup(Dense()) == "dense-extractor"
    assert reg.lookup(MyDense()) == "dense-extractor"  # subclasses match
    reg.register(MyDense, "my-extractor")
    assert reg.lookup(MyDense()) == "my-extractor"  # the closest registered class wins
    assert reg.lookup(Dense()) == "dense-extractor"
    assert reg.lookup(Base()) is None and reg.lookup(object()) is None
    reg.unregister(MyDense)
    assert reg.lookup(MyDense()) == "dense-extractor"
    reg.unregister(MyDense)  # a no-op


def test_ignore_and_unsupported_entries():
    reg = _registry()
    assert reg.lookup(Norm()) is IGNORE and repr(IGNORE) == "IGNORE"
    entry = reg.lookup(Odd())
    assert isinstance(entry, Unsupported) and entry.reason == "odd layers share weights across time"


def test_register_checks_the_class():
    reg = _registry()
    with pytest.raises(TypeError, match="testfw layer class"):
        reg.register(int, "x")
    with pytest.raises(TypeError, match="testfw layer class"):
        reg.register(Dense(), "x")
    LayerRegistry("any", None, "hint").register(int, "fine")  # base=None accepts any class


def test_entries_is_a_copy():
    reg = _registry()
    entries = reg.entries()
    entries.pop(Dense)
    assert reg.lookup(Dense()) == "dense-extractor"


def _skipped():
    skipped = Skipped(_registry())
    skipped.add("block.3", Odd())
    skipped.add("head.rnn", Norm(), reason="Norm is recurrent")
    skipped.add("x.y", Conv(), reason="transposed convolutions are not supported")
    return skipped


def test_skipped_messages():
    assert _skipped().messages() == [
        "block.3 (Odd has parameters but no registered extractor; register one with "
        "normflat.testfw.register_layer(cls, extractor))",
        "head.rnn (Norm is recurrent)",
        "x.y (Conv: transposed convolutions are not supported)",
    ]


def test_report_error():
    with pytest.raises(ValueError, match="normflat skips layers it cannot analyze: block.3 .*on_unsupported='warn'"):
        _skipped().report("error")


def test_report_warn_once_attributed_to_the_caller():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        msgs = _skipped().report("warn")
    assert len(rec) == 1  # one warning for all skipped layers
    assert issubclass(rec[0].category, UserWarning)
    assert "block.3" in str(rec[0].message) and "x.y" in str(rec[0].message)
    assert rec[0].filename == __file__  # not normflat/engine/registry.py
    assert len(msgs) == 3


def test_report_skip_and_nothing_skipped():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert len(_skipped().report("skip")) == 3
        assert Skipped(_registry()).report("warn") == []
        assert Skipped(_registry()).report("error") == []
    assert rec == []


def test_warn_user_direct_call():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        warn_user("look here", DeprecationWarning)
    assert len(rec) == 1 and rec[0].category is DeprecationWarning
    assert rec[0].filename == __file__


def test_warn_user_does_not_touch_the_filters():
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        inside = list(warnings.filters)
        warn_user("a")
        _skipped().report("warn")
        assert list(warnings.filters) == inside
    assert len(rec) == 2
    assert list(warnings.filters) == before
    # an "ignore" filter of the user's is respected
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("ignore")
        warn_user("silenced")
    assert rec == []


def test_warn_user_from_a_sibling_directory_of_the_package():
    # A user script in <parent>/normflat-study/ (or <parent>/normflat_tools/) is not part
    # of the package <parent>/normflat/, but the prefix test startswith(_PACKAGE_DIR) treats
    # it as normflat code and attributes the warning further up the stack. Fix: compare
    # with _PACKAGE_DIR + os.sep.
    user_file = registry_module._PACKAGE_DIR + "-study" + os.sep + "script.py"
    code = compile("def user_code():\n    warn_user('from the study script')\n", user_file, "exec")
    namespace = {"warn_user": warn_user}
    exec(code, namespace)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        namespace["user_code"]()
    assert rec[0].filename == user_file
