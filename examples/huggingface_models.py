"""Normalized sharpness of Hugging Face models: a GPT-2 language model, a BERT classifier, a ViT.

Every model is built from a tiny config (random initialization, nothing is
downloaded). The GPT-2 model is trained for a few seconds on a synthetic
language (counting sequences modulo the vocabulary) and analyzed on batches from
``DataCollatorForLanguageModeling``: token logits, labels shifted the way the
model's own loss shifts them, padding not counted, the tied ``wte`` / ``lm_head``
weight reported once, the packed ``c_attn`` split into query, key and value. The
BERT and ViT models are analyzed on batches from ``DataCollatorWithPadding`` and
``default_data_collator``.

Run: ``python examples/huggingface_models.py``
"""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from torch.utils.data import DataLoader

import normflat

VOCAB = 24


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the words ``w0 .. w21``, built in memory (id 0 pads)."""
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def counting_texts(n: int, seed: int) -> list[str]:
    """Sentences ``w(s) w(s+1) ...`` of 4 to 8 words (modulo 22): the next word is predictable."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB - 2, (n,), generator=g).tolist()
    lengths = torch.randint(4, 9, (n,), generator=g).tolist()
    return [" ".join(f"w{(s + i) % (VOCAB - 2)}" for i in range(k)) for s, k in zip(starts, lengths)]


def gpt2_language_model(tok: transformers.PreTrainedTokenizerFast) -> None:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)  # labels = input_ids, -100 at padding
    train = DataLoader([tok(t) for t in counting_texts(256, 0)], batch_size=32, shuffle=True, collate_fn=collator,
                       generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(10):
        for batch in train:
            opt.zero_grad()
            model(**batch).loss.backward()  # the model shifts the labels itself
            opt.step()
    model.eval()

    data = DataLoader([tok(t) for t in counting_texts(8, 1)], batch_size=8, collate_fn=collator)
    with torch.no_grad():
        loss = sum(float(model(**b).loss) for b in data) / len(data)
    print(f"GPT-2: held-out loss {loss:.3f} (log {VOCAB} = {torch.log(torch.tensor(VOCAB)).item():.3f})")
    report = normflat.analyze(model, data, loss="ce", progress=False)  # shift_labels=None: yes, a causal LM
    print(report)
    meta = report.metadata
    print(f"counted tokens (loss_terms): {meta['loss_terms']}, coverage {meta['coverage']:.3f}")
    print(f"{report.layers[0].name} is shared with {report.layers[0].details['shared_with']}")
    print("excluded (first 4):", dict(list(meta["excluded"].items())[:4]))


def bert_classifier(tok: transformers.PreTrainedTokenizerFast) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3, pad_token_id=0)
    model = transformers.BertForSequenceClassification(config)
    examples = [{**tok(t), "label": i % 3} for i, t in enumerate(counting_texts(48, 2))]
    data = DataLoader(examples, batch_size=16, collate_fn=transformers.DataCollatorWithPadding(tok))
    report = normflat.analyze(model, data, progress=False)
    print(f"BERT: {len(report.layers)} matrices, coverage {report.metadata['coverage']:.3f}, "
          f"normalized sharpness {report.normalized_sharpness:.4g}")
    print("  " + ", ".join(layer.name for layer in report.layers[:4]) + ", ...")


def vit_classifier() -> None:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3)
    model = transformers.ViTForImageClassification(config)
    g = torch.Generator().manual_seed(3)
    examples = [{"pixel_values": torch.randn(3, 16, 16, generator=g), "label": i % 3} for i in range(32)]
    data = DataLoader(examples, batch_size=16, collate_fn=transformers.default_data_collator)
    report = normflat.analyze(model, data, progress=False)
    table = report.layer("vit.embeddings.position_embeddings")
    print(f"ViT: coverage {report.metadata['coverage']:.3f}; position table {table.shape} "
          f"(features, positions), kind {table.kind!r}; excluded: "
          f"{report.metadata['excluded']['vit.embeddings.cls_token']!r} (cls_token)")


def main() -> None:
    torch.manual_seed(0)
    tok = word_tokenizer()
    gpt2_language_model(tok)
    bert_classifier(tok)
    vit_classifier()


if __name__ == "__main__":
    main()
