"""Attention under 2-bit pre-RoPE keys, offline: the table of docs/notes/2026-12-05-keys-on-their-own-axes.md.

    python docs/results/key_axes_offline.py ../shared/data/books/pg1342-pride-and-prejudice.txt

Captures SmolLM2-135M's queries, keys (before RoPE) and values on 2,048 tokens of the book (from its 20,000th
character), rounds the keys of every third layer after the first 4 tokens on grids fitted to the next 220, keeps
the last 32 keys before each query exact, and prints, for each way of rounding, the KL divergence of attention and
the relative error of its output at 96 query positions past 1,024, against exact keys. Every grid spans its
calibration values' 1st to 99th percentile (a quarter of that share from 3 bits on). A study script: kvcli's own
grid is :mod:`kvcli.kv.basis`.
"""

from __future__ import annotations

import sys

import torch

from kvcli.kv.basis import allocate
from kvcli.kv.quant import rotation
from kvcli.models.load import load_model

TOKENS, CALIBRATION, SINKS, RESIDUAL, CLIP = 2048, 220, 4, 32, 0.01
SCHEMES = ("channel", "rotated channel", "axes", "axes weighed by the queries", "axes weighed by the query weights")


def capture(book: str):
    """Per layer the pre-RoPE queries, keys and values ``[heads, tokens, D]``, and the model's RoPE cos and sin."""
    model = load_model(dtype="float32", device="cpu")
    ids = model.tokenizer(open(book, encoding="utf-8").read()[20000:200000], return_tensors="pt").input_ids
    ids = ids[:, :TOKENS]
    caps: dict[tuple[str, int], torch.Tensor] = {}
    for i, layer in enumerate(model.model.model.layers):
        for name in "qkv":
            getattr(layer.self_attn, f"{name}_proj").register_forward_hook(
                lambda mod, inp, out, key=(name, i): caps.__setitem__(key, out.detach()[0]))
    with torch.no_grad():
        model.model(ids)
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    cos, sin = model.model.model.rotary_emb(torch.zeros(1, TOKENS, dim), torch.arange(TOKENS)[None])
    return model, caps, cos[0], sin[0]


def rounded(x: torch.Tensor, calibration: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, C]`` rounded per column on a grid over ``calibration``'s quantiles, ``widths`` bits a column."""
    out = torch.empty_like(x)
    for c, width in enumerate(widths.tolist()):
        if width == 0:
            out[:, c] = calibration[:, c].mean()
            continue
        share = CLIP if width <= 2 else CLIP / 4
        low, high = calibration[:, c].quantile(share), calibration[:, c].quantile(1 - share)
        step = (high - low).clamp_min(1e-6) / (2 ** width - 1)
        out[:, c] = ((x[:, c] - low) / step).round().clamp(0, 2 ** width - 1) * step + low
    return out


def pair_mean(square: torch.Tensor) -> torch.Tensor:
    half = square.shape[0] // 2
    pair = (square[:half] + square[half:]) / 2
    return torch.cat((pair, pair))


def round_keys(scheme: str, keys: torch.Tensor, queries: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """One head's keys ``[n, D]`` rounded the ``scheme`` way at 2 bits a channel on average."""
    dim = keys.shape[1]
    calibration = keys[SINKS:SINKS + CALIBRATION]
    if scheme in ("channel", "rotated channel"):
        turn = rotation(dim) if scheme == "rotated channel" else torch.eye(dim)
        return rounded(keys @ turn, calibration @ turn, torch.full((dim,), 2)) @ turn.T
    weight = torch.ones(dim)
    if scheme == "axes weighed by the queries":
        weight = pair_mean(queries.square().mean(dim=(0, 1)))
    elif scheme == "axes weighed by the query weights":
        weight = pair_mean(projection)
    root = weight.sqrt()
    scaled = calibration * root
    centred = scaled - scaled.mean(0)
    variance, axes = torch.linalg.eigh(centred.T @ centred / len(centred))
    widths = allocate(variance.clamp_min(1e-12)[None], 2 * dim)[0].long()
    return rounded(keys * root @ axes, scaled @ axes, widths) @ axes.T / root


def main(book: str) -> None:
    model, caps, cos, sin = capture(book)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim, group = config.hidden_size // heads, heads // kv_heads

    def rope(x):
        return x * cos + torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1) * sin

    at = torch.randint(1024, TOKENS, (96,), generator=torch.Generator().manual_seed(1))
    hidden = torch.arange(TOKENS)[None, :] > at[:, None]
    exact_near = torch.arange(TOKENS)[None, :] > at[:, None] - RESIDUAL
    totals = {scheme: [0.0, 0.0] for scheme in SCHEMES}
    count = 0
    for layer in range(0, config.num_hidden_layers, 3):
        attention = model.model.model.layers[layer]
        weighed = attention.self_attn.q_proj.weight.detach() * attention.input_layernorm.weight.detach()[None]
        rows = weighed.square().sum(1).view(heads, dim)
        q, k, v = (caps[(name, layer)].view(TOKENS, -1, dim).transpose(0, 1) for name in "qkv")
        for h in range(kv_heads):
            queries = q[h * group:(h + 1) * group]
            turned = rope(queries)[:, at]
            exact = (turned @ rope(k[h]).T / dim ** 0.5).masked_fill(hidden, -1e9)
            p = exact.softmax(-1)
            out = p @ v[h]
            for scheme in SCHEMES:
                keys = round_keys(scheme, k[h], queries, rows[h * group:(h + 1) * group].mean(0))
                keys[:SINKS] = k[h][:SINKS]
                logits = torch.where(exact_near, exact, turned @ rope(keys).T / dim ** 0.5).masked_fill(hidden, -1e9)
                p_hat = logits.softmax(-1)
                kl = (p * (p.clamp_min(1e-30).log() - p_hat.clamp_min(1e-30).log())).sum(-1).mean()
                error = ((p_hat @ v[h] - out).norm(dim=-1) / out.norm(dim=-1)).mean()
                totals[scheme][0] += float(kl)
                totals[scheme][1] += float(error)
            count += 1
    print("| keys at 2 bits | KL of attention | output error (relative) |\n|---|---:|---:|")
    for scheme, (kl, error) in totals.items():
        print(f"| {scheme} | {kl / count:.4f} | {error / count:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1])
