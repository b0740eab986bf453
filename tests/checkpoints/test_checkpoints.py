"""normflat.checkpoints: every checkpoint kind loads, every wrong combination is a one-line CheckpointError."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import uuid
import zipfile

import numpy as np
import pytest

from tests.builders import require_frameworks

import normflat  # noqa: E402
from normflat.checkpoints import (  # noqa: E402
    CheckpointError,
    accuracy,
    check_fits,
    load_data,
    load_model,
    predict,
    resolve_factory,
)
from normflat.cli import main  # noqa: E402


def _module(tmp_path, monkeypatch, body: str) -> str:
    """Write a uniquely named factory module into tmp_path (the current directory)."""
    name = f"facs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    return name


TORCH_FACTORY = """
    import torch
    from torch import nn

    def make_net():
        torch.manual_seed(123)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))

    def make_wide():
        return nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))

    def make_other():
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 3))

    def broken():
        raise RuntimeError("no GPU here")

    NOT_CALLABLE = 3
"""


def _xy(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.fixture
def torch_setup(tmp_path, monkeypatch):
    require_frameworks("torch")
    import torch

    name = _module(tmp_path, monkeypatch, TORCH_FACTORY)
    net = resolve_factory(f"{name}:make_net")()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))  # "trained": differs from a fresh factory model
    return name, net


def test_state_dict_and_safetensors_with_a_factory(tmp_path, torch_setup):
    import torch

    name, net = torch_setup
    torch.save(net.state_dict(), tmp_path / "w.pt")
    from safetensors.torch import save_file

    save_file(net.state_dict(), str(tmp_path / "w.safetensors"))
    x, y = _xy()
    direct = normflat.analyze(net, (torch.as_tensor(x), torch.as_tensor(y)), progress=False)
    for file in ("w.pt", "w.safetensors"):
        model = load_model(tmp_path / file, factory=f"{name}:make_net")
        for a, b in zip(model.state_dict().values(), net.state_dict().values()):
            assert torch.equal(a, b)
        assert not model.training
        report = normflat.analyze(model, (torch.as_tensor(x), torch.as_tensor(y)), progress=False)
        assert report.normalized_sharpness == pytest.approx(direct.normalized_sharpness, rel=1e-12)
    # a file path works as the factory module too
    model = load_model(tmp_path / "w.pt", factory=str(tmp_path / f"{name}.py") + ":make_net")
    assert torch.equal(model[0].weight, net[0].weight)
    # a Lightning-style {"state_dict": ...} checkpoint
    torch.save({"state_dict": net.state_dict(), "epoch": 3}, tmp_path / "lit.ckpt")
    assert torch.equal(load_model(tmp_path / "lit.ckpt", factory=f"{name}:make_net")[2].bias, net[2].bias)


def test_state_dict_errors_name_the_cause_and_the_fix(tmp_path, torch_setup):
    import torch

    name, net = torch_setup
    torch.save(net.state_dict(), tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match="holds a state_dict.*--model module:function"):
        load_model(tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=r"missing keys: 4.weight, 4.bias") as err:
        load_model(tmp_path / "w.pt", factory=f"{name}:make_other")
    _one_line(err)
    with pytest.raises(CheckpointError, match=r"0.weight has shape \(6, 4\) in the file but \(7, 4\)"):
        load_model(tmp_path / "w.pt", factory=f"{name}:make_wide")
    torch.save({"module." + k: v for k, v in net.state_dict().items()}, tmp_path / "ddp.pt")
    with pytest.raises(CheckpointError, match="unexpected keys: module.0.weight.*prefix 'module.'"):
        load_model(tmp_path / "ddp.pt", factory=f"{name}:make_net")
    with pytest.raises(CheckpointError, match="no function 'nope'.*make_net"):
        load_model(tmp_path / "w.pt", factory=f"{name}:nope")
    with pytest.raises(CheckpointError, match="Cannot import the factory module 'no_such_mod'"):
        load_model(tmp_path / "w.pt", factory="no_such_mod:make")
    with pytest.raises(CheckpointError, match="must be 'module:function'"):
        load_model(tmp_path / "w.pt", factory="make_net")
    with pytest.raises(CheckpointError, match="not a function"):
        load_model(tmp_path / "w.pt", factory=f"{name}:NOT_CALLABLE")
    with pytest.raises(CheckpointError, match="factory 'broken' failed.*no GPU here"):
        load_model(tmp_path / "w.pt", factory=f"{name}:broken")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing.pt", factory=f"{name}:make_net")
    with pytest.raises(CheckpointError, match="holds weights only"):
        (tmp_path / "w.safetensors").write_bytes(b"")
        load_model(tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match="Cannot read .* as a safetensors file"):
        load_model(tmp_path / "w.safetensors", factory=f"{name}:make_net")
    (tmp_path / "w.onnx").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="Unknown checkpoint type '.onnx'"):
        load_model(tmp_path / "w.onnx")
    assert load_model(tmp_path / "w.pt", factory=f"{name}:make_net", framework="torch") is not None
    with pytest.raises(CheckpointError, match="loaded as a torch model, but --framework keras"):
        load_model(tmp_path / "w.pt", factory=f"{name}:make_net", framework="keras")
    with pytest.raises(CheckpointError, match="Unknown framework"):
        load_model(tmp_path / "w.pt", framework="mxnet")


def test_pickled_module_needs_trust_pickle(tmp_path, torch_setup):
    import torch

    name, net = torch_setup
    torch.save(net, tmp_path / "whole.pt")
    with pytest.raises(CheckpointError, match="runs code from the file.*--trust-pickle") as err:
        load_model(tmp_path / "whole.pt")
    _one_line(err)
    model = load_model(tmp_path / "whole.pt", trust_pickle=True)
    assert torch.equal(model[0].weight, net[0].weight)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a state_dict of tensors"):
        load_model(tmp_path / "list.pt", factory=f"{name}:make_net")
    torch.jit.save(torch.jit.script(net), tmp_path / "scripted.pt")
    with pytest.raises(CheckpointError, match="TorchScript"):
        load_model(tmp_path / "scripted.pt")


def test_hf_directory_loads_offline(tmp_path, monkeypatch):
    require_frameworks("torch", "transformers")
    import torch
    import transformers

    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50, max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    view = load_model(tmp_path / "hf")
    ids = torch.randint(1, 50, (5, 8))
    assert torch.allclose(view(ids), hf(input_ids=ids).logits)
    y = np.array([0, 1, 2, 0, 1])
    report = normflat.analyze(view, (ids, torch.as_tensor(y)), progress=False, on_unsupported="skip")
    assert "classifier" in [layer.name for layer in report.layers]
    assert 0.0 <= accuracy(view, (ids.numpy(), y)) <= 1.0
    # the command line on the directory, with token ids in an .npz
    np.savez(tmp_path / "tokens.npz", x=ids.numpy(), y=y)
    assert main(["analyze", str(tmp_path / "hf"), "--data", str(tmp_path / "tokens.npz"),
                 "--on-unsupported", "skip", "--no-progress", "--json", str(tmp_path / "hf.json")]) == 0
    saved = json.loads((tmp_path / "hf.json").read_text())
    assert saved["totals"]["normalized_sharpness"] == pytest.approx(report.normalized_sharpness, rel=1e-5)
    with pytest.raises(CheckpointError, match="holds its architecture"):
        load_model(tmp_path / "hf", factory="x:y")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a Hugging Face model directory"):
        load_model(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="Cannot load the Hugging Face directory"):
        load_model(tmp_path / "broken")


def test_keras_file_and_a_corrupted_one(tmp_path):
    require_frameworks("tensorflow", "keras")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])
    model.save(tmp_path / "m.keras")
    loaded = load_model(tmp_path / "m.keras")
    x, y = _xy()
    np.testing.assert_allclose(predict(loaded, x), predict(model, x), rtol=1e-6)
    (tmp_path / "bad.keras").write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointError, match="not a valid .keras file") as err:
        load_model(tmp_path / "bad.keras")
    assert "File not found" not in _one_line(err)
    with zipfile.ZipFile(tmp_path / "empty.keras", "w") as zf:
        zf.writestr("junk.txt", "x")
    with pytest.raises(CheckpointError, match="Cannot load .* as a Keras model"):
        load_model(tmp_path / "empty.keras")
    with pytest.raises(CheckpointError, match="drop the model factory"):
        load_model(tmp_path / "m.keras", factory="a:b")


EQX_FACTORY = """
    import jax, equinox as eqx

    def make():
        return eqx.nn.MLP(4, 3, 6, depth=1, key=jax.random.PRNGKey(0))

    def make_wide():
        return eqx.nn.MLP(4, 3, 9, depth=1, key=jax.random.PRNGKey(0))
"""


def test_equinox_checkpoint_with_a_factory(tmp_path, monkeypatch):
    require_frameworks("jax", "equinox")
    import equinox as eqx
    import jax

    name = _module(tmp_path, monkeypatch, EQX_FACTORY)
    trained = eqx.nn.MLP(4, 3, 6, depth=1, key=jax.random.PRNGKey(5))
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", trained)
    model = load_model(tmp_path / "m.eqx", factory=f"{name}:make")
    np.testing.assert_array_equal(np.asarray(model.layers[0].weight), np.asarray(trained.layers[0].weight))
    x, y = _xy()
    np.testing.assert_allclose(predict(model, x), np.asarray(jax.vmap(trained)(x)), rtol=1e-6)
    report = normflat.analyze(model, (x, y), progress=False)
    assert len(report.layers) == 2
    with pytest.raises(CheckpointError, match="do not fit the factory's model"):
        load_model(tmp_path / "m.eqx", factory=f"{name}:make_wide")
    with pytest.raises(CheckpointError, match="equinox checkpoint.*--model"):
        load_model(tmp_path / "m.eqx")


NNX_FACTORY = """
    import jax, flax.linen as linen, jax.numpy as jnp
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, hidden, rngs):
            self.l1 = nnx.Linear(4, hidden, rngs=rngs)
            self.l2 = nnx.Linear(hidden, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    def make():
        return Net(6, nnx.Rngs(0))

    def make_wide():
        return Net(9, nnx.Rngs(0))

    class Lin(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(3)(linen.relu(linen.Dense(6)(x)))

    def make_linen():
        m = Lin()
        return m, m.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
"""


def test_flax_msgpack_checkpoints_nnx_and_linen(tmp_path, monkeypatch):
    require_frameworks("jax", "flax")
    import flax.serialization
    import jax

    from normflat.checkpoints import save_flax_nnx

    name = _module(tmp_path, monkeypatch, NNX_FACTORY)
    mod = sys.modules[resolve_factory(f"{name}:make").__module__]
    from flax import nnx

    trained = mod.Net(6, nnx.Rngs(42))
    save_flax_nnx(trained, tmp_path / "nnx.msgpack")
    model = load_model(tmp_path / "nnx.msgpack", factory=f"{name}:make")
    x, y = _xy()
    np.testing.assert_array_equal(predict(model, x), predict(trained, x))
    assert normflat.analyze(model, (x, y), progress=False).normalized_sharpness > 0
    with pytest.raises(CheckpointError, match="does not fit|do not fit"):
        load_model(tmp_path / "nnx.msgpack", factory=f"{name}:make_wide")
    module, variables = mod.make_linen()
    variables = jax.tree_util.tree_map(lambda a: a + 1.0, variables)
    (tmp_path / "linen.msgpack").write_bytes(flax.serialization.to_bytes(variables))
    pair = load_model(tmp_path / "linen.msgpack", factory=f"{name}:make_linen")
    np.testing.assert_allclose(predict(pair, x), np.asarray(module.apply(variables, x)), rtol=1e-6)
    (tmp_path / "bad.msgpack").write_bytes(b"\xc1\xc1garbage")
    with pytest.raises(CheckpointError, match="Cannot read .* as a flax msgpack file"):
        load_model(tmp_path / "bad.msgpack", factory=f"{name}:make")


def test_load_data_formats_and_errors(tmp_path, monkeypatch):
    x, y = _xy()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    got = load_data(tmp_path / "d.npz")
    np.testing.assert_array_equal(got[0], x) and np.testing.assert_array_equal(got[1], y)
    np.savez(tmp_path / "two.npz", inputs=x, labels=y)
    np.testing.assert_array_equal(load_data(str(tmp_path / "two.npz"))[1], y)
    (tmp_path / "folder").mkdir()
    np.save(tmp_path / "folder" / "x.npy", x)
    np.save(tmp_path / "folder" / "y.npy", y)
    np.testing.assert_array_equal(load_data(tmp_path / "folder")[0], x)
    name = _module(tmp_path, monkeypatch, """
        import numpy as np
        def batches():
            rng = np.random.default_rng(0)
            return [(rng.normal(size=(4, 4)), np.arange(4) % 3) for _ in range(3)]
        def nothing():
            return None
        def fails():
            raise OSError("disk gone")
    """)
    assert len(load_data(f"{name}:batches")) == 3
    cases = {
        "x.npy": "single .npy array",
        "text.npz": "not an .npz file.*not a zip archive",
        "empty.npz": "is empty",
        "three.npz": "must hold arrays named 'x' and 'y'",
        "floats.npz": "which are the labels is unclear",
        "badshape.npz": "one row per label",
        "softy.npz": "1-D array of integer class labels",
    }
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "text.npz").write_text("hello")
    (tmp_path / "empty.npz").write_bytes(b"")
    np.savez(tmp_path / "three.npz", a=x, b=y, c=y)
    np.savez(tmp_path / "floats.npz", a=x, b=x)
    np.savez(tmp_path / "badshape.npz", x=x[:5], y=y)
    np.savez(tmp_path / "softy.npz", x=x, y=np.full((40, 3), 1 / 3))
    for file, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as err:
            load_data(tmp_path / file)
        _one_line(err)
    (tmp_path / "half").mkdir()
    np.save(tmp_path / "half" / "x.npy", x)
    with pytest.raises(CheckpointError, match="lacks y.npy"):
        load_data(tmp_path / "half")
    with pytest.raises(CheckpointError, match="returned None"):
        load_data(f"{name}:nothing")
    with pytest.raises(CheckpointError, match="failed.*disk gone"):
        load_data(f"{name}:fails")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_data(tmp_path / "nope.npz")
    assert issubclass(CheckpointError, ValueError)


def _cli_error(argv, capsys) -> str:
    """The one ``normflat: error:`` line of a command that must fail with exit status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("normflat: error: ") and "Traceback" not in err, err
    return err


def test_analyze_cli_on_a_state_dict(tmp_path, torch_setup, capsys):
    import torch

    name, net = torch_setup
    torch.save(net.state_dict(), tmp_path / "w.pt")
    from safetensors.torch import save_file

    save_file(net.state_dict(), str(tmp_path / "w.safetensors"))
    x, y = _xy()
    np.savez(tmp_path / "train.npz", x=x, y=y)
    assert main(["analyze", str(tmp_path / "w.pt"), "--model", f"{name}:make_net", "--data",
                 str(tmp_path / "train.npz"), "--no-progress", "--plot", str(tmp_path / "l.png"),
                 "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "report written to" in out
    report = json.loads((tmp_path / "w.normflat.json").read_text())
    direct = normflat.analyze(net, (torch.as_tensor(x), torch.as_tensor(y)), progress=False)
    # float32 sums over 16-example batches vs one batch: equal to rounding
    assert report["totals"]["normalized_sharpness"] == pytest.approx(direct.normalized_sharpness, rel=1e-5)
    assert (tmp_path / "l.png").stat().st_size > 1000
    assert main(["analyze", str(tmp_path / "w.pt"), "--model", f"{name}:make_net", "--data",
                 str(tmp_path / "train.npz"), "--float64", "--json", str(tmp_path / "r64.json"),
                 "--no-progress"]) == 0
    report64 = json.loads((tmp_path / "r64.json").read_text())
    assert report64["metadata"]["dtype"] == "float64"
    # a safetensors file and a folder of .npy files
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", x)
    np.save(tmp_path / "npy" / "y.npy", y)
    assert main(["analyze", str(tmp_path / "w.safetensors"), "--model", f"{name}:make_net", "--data",
                 str(tmp_path / "npy"), "--no-progress", "--batch-size", "16"]) == 0
    saved = json.loads((tmp_path / "w.normflat.json").read_text())
    assert saved["totals"]["normalized_sharpness"] == pytest.approx(report["totals"]["normalized_sharpness"],
                                                                    rel=1e-12)
    # a pickled whole module only with --trust-pickle
    torch.save(net, tmp_path / "whole.pt")
    err = _cli_error(["analyze", str(tmp_path / "whole.pt"), "--data", str(tmp_path / "train.npz")], capsys)
    assert "--trust-pickle" in err and "runs code from the file" in err
    assert main(["analyze", str(tmp_path / "whole.pt"), "--trust-pickle", "--data", str(tmp_path / "train.npz"),
                 "--no-progress", "--json", str(tmp_path / "whole.json")]) == 0
    err = _cli_error(["analyze", str(tmp_path / "w.pt"), "--data", str(tmp_path / "train.npz")], capsys)
    assert "--model module:function" in err
    err = _cli_error(["analyze", str(tmp_path / "w.pt"), "--model", f"{name}:make_net", "--data",
                      str(tmp_path / "train.npz"), "--json", str(tmp_path / "nodir" / "r.json")], capsys)
    assert "does not exist" in err and "create it" in err
    err = _cli_error(["analyze", str(tmp_path / "w.pt"), "--model", f"{name}:make_wide", "--data",
                      str(tmp_path / "train.npz")], capsys)
    assert "do not match the factory's architecture" in err
    np.savez(tmp_path / "wide.npz", x=np.zeros((4, 5), "float32"), y=np.zeros(4, dtype=int))
    err = _cli_error(["analyze", str(tmp_path / "w.pt"), "--model", f"{name}:make_net", "--data",
                      str(tmp_path / "wide.npz")], capsys)
    assert "cannot take x" in err and "shape (4, 5)" in err


def test_check_fits(torch_setup):
    _, net = torch_setup
    x, y = _xy()
    check_fits(net, (x, y))
    with pytest.raises(CheckpointError, match="cannot take x from d.npz: x has shape"):
        check_fits(net, (np.zeros((3, 5), "float32"), np.zeros(3, dtype=int)), "d.npz")
    with pytest.raises(CheckpointError, match="labels up to 7, but the model outputs 3 classes"):
        check_fits(net, (x, np.full(len(x), 7)))
    net.train()
    check_fits(net, (x, y))
    assert net.training  # one forward in eval mode, the mode restored
    check_fits(net, [(x, y)])  # a loader is not consumed: not checked
