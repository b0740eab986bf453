"""Track normalized sharpness with a Hugging Face ``Trainer`` callback (tiny BERT from a config, CPU).

The model is built from a ``BertConfig`` (nothing is downloaded) and trained on
synthetic token sequences whose class is set by their first token. Every weight
matrix is analyzed: embeddings, attention projections and dense layers (biases,
LayerNorm parameters and the like are listed in the report's ``excluded``).

Run: ``python examples/track_huggingface.py [figure.png]`` (default ``tracking_huggingface.png``).
"""

from __future__ import annotations

import sys
import tempfile

import torch
import transformers

from normflat.integrations.huggingface import SharpnessCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 100, (n, 12), generator=g)
        self.labels = self.ids[:, 0] * 4 // 100  # 4 classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
                "labels": self.labels[i]}


def main(figure: str = "tracking_huggingface.png") -> None:
    transformers.set_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16, num_labels=4)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), num_train_epochs=4,
                                          per_device_train_batch_size=32, learning_rate=2e-3, logging_steps=10,
                                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(512, 0))
    cb = SharpnessCallback(Tokens(128, 1), every_n_steps=8, batch_size=64,
                           log=("normalized_sharpness", "hessian_trace"))
    cb.attach(trainer)  # log through trainer.log: log_history, TensorBoard, W&B ...
    trainer.train()
    logged = [e for e in trainer.state.log_history if "normalized_sharpness" in e]
    print(f"{len(logged)} analyses in trainer.state.log_history; last: {logged[-1]}")
    cb.history.plot(figure, title="Hugging Face Trainer: tiny BERT")
    print(f"figure written to {figure}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
