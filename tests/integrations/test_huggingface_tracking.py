"""The Hugging Face TrainerCallback in a real Trainer run: the run is unchanged, values are logged."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch", "transformers", "accelerate")

import torch  # noqa: E402
import transformers  # noqa: E402

from normflat.integrations.huggingface import HFLogits, SharpnessCallback  # noqa: E402


class _Examples(torch.utils.data.Dataset):
    """Token sequences whose label is decided by the first token (learnable)."""


    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 50, (n, 8), generator=g)
        # Three classes: with two, the normalized softmax (nsce) keeps only the sign of the
        # logit difference and its curvature is zero.
        self.labels = self.ids[:, 0] * 3 // 50

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": self.labels[i]}


def _model() -> transformers.PreTrainedModel:
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50, max_position_embeddings=16,
                                     num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _run(tmp_path, callback=None, attach=False):
    transformers.set_seed(0)
    model = _model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), num_train_epochs=2, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Examples(48, 0),
                                   callbacks=None if callback is None or attach else [callback])
    if attach:
        callback.attach(trainer)
    trainer.train()
    draws = (float(torch.rand(())), float(np.random.random()), random.random())
    return model, trainer, draws


def _assert_same(a, b):
    (m1, t1, d1), (m2, t2, d2) = a, b
    for (k, v1), v2 in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(v1, v2), k
    s1, s2 = t1.optimizer.state_dict()["state"], t2.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys() and s1
    for k in s1:
        for name in s1[k]:
            assert torch.equal(s1[k][name], s2[k][name]), (k, name)
    assert d1 == d2


def test_hf_callback_leaves_the_run_bit_identical_and_logs(tmp_path):
    cb = SharpnessCallback(_Examples(24, 1), every_n_steps=4, max_batches=2, batch_size=8, on_unsupported="skip",
                           log=("normalized_sharpness", "hessian_trace"), per_layer=True, prefix="eval_")
    base = _run(tmp_path / "a")
    tracked = _run(tmp_path / "b", cb)
    _assert_same(base, tracked)
    # 6 steps per epoch, 12 in all: analyses after steps 4, 8, 12.
    assert cb.history.steps == [4, 8, 12]
    assert cb.history.epochs == [0, 1, 1]
    names = cb.history.layer_names
    assert "classifier" in names and "bert.pooler.dense" in names
    assert "bert.embeddings.word_embeddings" in names  # embeddings are weight matrices (method §3)
    entries = [e for e in tracked[1].state.log_history if "eval_normalized_sharpness" in e]
    assert [e["step"] for e in entries] == [4, 8, 12]
    assert entries[-1]["eval_normalized_sharpness"] == cb.history[-1].normalized_sharpness
    assert "eval_normalized_sharpness/classifier" in entries[0]
    assert all(math.isfinite(v) and v > 0 for v in cb.history.values("normalized_sharpness"))
    # The model is left in train mode, as the Trainer had it.
    assert tracked[0].training


def test_hf_callback_by_epoch_through_trainer_log(tmp_path):
    ds = _Examples(16, 2)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=transformers.default_data_collator)
    cb = SharpnessCallback(loader, every_n_epochs=1, on_unsupported="skip", log="normalized_sharpness")
    seen = []

    class Spy(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    base = _run(tmp_path / "a")
    model, trainer, draws = _run(tmp_path / "b", cb, attach=True)
    _assert_same(base, (model, trainer, draws))
    assert cb.history.epochs == [0, 1] and cb.history.steps == [6, 12]
    logged = [e for e in trainer.state.log_history if "normalized_sharpness" in e]
    assert len(logged) == 2 and "hessian_trace" not in logged[0]
    # trainer.log reached the other callbacks (the reporting integrations) too.
    transformers.set_seed(0)
    cb2 = SharpnessCallback(loader, every_n_epochs=1, on_unsupported="skip", log="normalized_sharpness")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "c"), num_train_epochs=1,
                                          per_device_train_batch_size=8, save_strategy="no", report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    t = transformers.Trainer(model=_model(), args=args, train_dataset=ds, callbacks=[Spy()])
    cb2.attach(t)
    t.train()
    assert any("normalized_sharpness" in logs for logs in seen)


def test_hf_view_keeps_the_model_names_and_logits():
    model = _model().eval()
    view = HFLogits(model, keys=("attention_mask", "input_ids"))
    names = [n for n, _ in view.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    ids = torch.randint(1, 50, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    assert torch.equal(view(mask, ids), model(input_ids=ids, attention_mask=mask).logits)
    view.train()
    assert model.training
    with pytest.raises(ValueError, match="labels"):
        cb = SharpnessCallback([{"input_ids": ids}], on_unsupported="skip")
        cb._analyze(model, type("S", (), {"global_step": 1, "epoch": 1.0, "log_history": []})(), 0)
