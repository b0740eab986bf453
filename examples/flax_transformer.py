"""Normalized sharpness of a tiny flax nnx transformer classifier, per weight matrix.

Trains a one-block transformer (token embedding, multi-head self-attention, MLP,
LayerNorm, mean-pooled head) for a few seconds on a synthetic task (which of the
tokens 0, 1, 2 is the most frequent in the sequence?), then analyzes it with the exact
GGN diagonal: the embedding table, the query/key/value/output projections of
the attention (kernels ``(d, heads, head_dim)`` and ``(heads, head_dim, d)``,
each read as one matrix, method §3) and the MLP are all weight matrices. The
batch is a Hugging Face style mapping with keyword inputs and the model returns
a dict. Finally a per-head rescaling of the queries and keys, which leaves every
attention score unchanged, leaves normalized sharpness unchanged while the
Hessian trace moves (method §8).

Run: ``python examples/flax_transformer.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import normflat

VOCAB, LENGTH, WIDTH, HEADS = 8, 6, 16, 2


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

    def __call__(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        h = h + self.attention(self.norm1(h), mask=nnx.make_attention_mask(attention_mask, attention_mask))
        h = h + self.down(nnx.relu(self.up(self.norm2(h))))
        w = attention_mask[..., None].astype(h.dtype)
        return {"logits": self.head((h * w).sum(1) / w.sum(1))}


def make_data(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, LENGTH))
    lengths = rng.integers(3, LENGTH + 1, size=n)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    counts = np.stack([((ids == t) & mask).sum(1) for t in range(3)], axis=1)
    labels = counts.argmax(1).astype(np.int32)  # 3 classes: with 2, nsce's normalized logits are ±1
    return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), "labels": jnp.asarray(labels)}


def train(model: Transformer, data: dict, steps: int = 150, lr: float = 0.1) -> None:
    def loss_fn(m):
        logits = m(data["input_ids"], data["attention_mask"])["logits"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), data["labels"]])

    @nnx.jit
    def step(m):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        params = nnx.state(m, nnx.Param)
        nnx.update(m, jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads))
        return loss

    for _ in range(steps):
        loss = step(model)
    print(f"training loss {float(loss):.3f}")


def main() -> None:
    train_data, test_data = make_data(512, 0), make_data(256, 1)
    model = Transformer(nnx.Rngs(0))
    train(model, train_data)
    logits = model(test_data["input_ids"], test_data["attention_mask"])["logits"]
    print(f"test accuracy {float((logits.argmax(-1) == test_data['labels']).mean()):.2f}")

    # A mapping with "labels" is one keyword batch: the model is called as model(**inputs),
    # and the logits are taken from its dict output.
    report = normflat.analyze(model, test_data, estimator="ggn", loss="nsce", progress=False)
    print(report)
    print(f"coverage {report.metadata['coverage']:.2f}; excluded: {sorted(report.metadata['excluded'])}")

    # Queries of head h times c_h, keys of head h times 1/c_h: every attention score is unchanged.
    scaled = nnx.clone(model)
    c = jnp.asarray([4.0, 0.25])
    for proj, factor in ((scaled.attention.query, c), (scaled.attention.key, 1 / c)):
        proj.kernel[...] = proj.kernel[...] * factor[None, :, None]  # kernel (d, heads, head_dim)
        proj.bias[...] = proj.bias[...] * factor[:, None]
    moved = normflat.analyze(scaled, test_data, estimator="ggn", loss="nsce", progress=False)
    print(f"per-head rescaling: normalized sharpness {report.normalized_sharpness:.6g} -> "
          f"{moved.normalized_sharpness:.6g}, Hessian trace {report.hessian_trace:.4g} -> {moved.hessian_trace:.4g}")


if __name__ == "__main__":
    main()
