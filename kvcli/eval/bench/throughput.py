"""Engine throughput next to plain transformers baselines on the same tokens (a script, not a test).

    python -m kvcli.eval.bench.throughput BOOK --tokens 32768 --cache 1024 --block 256

prints, for the same token stream, model and dtype:

* ``engine``: kvcli's streamed perplexity with the given method, cache and block;
* ``plain-blocks``: a plain transformers forward (stock SDPA attention, ``DynamicCache``) of blocks of
  the same size against a cache of the same size: what one block costs without kvcli's bookkeeping;
* ``hf-sliding``: Hugging Face's documented sliding-window perplexity (window = cache, stride = cache/2);
* ``plain-forward``: when the tokens fit the model's trained context, the perplexity of one plain forward
  pass over all of them, next to the engine's (with ``--method full`` the two must agree).

    python -m kvcli.eval.bench.throughput --attention

times one layer's attention instead (no model, no book): kvcli's explicit path against SDPA plus the
observation window, for the shapes that decide ``attention.CAUSAL_KERNEL_FROM``.

The numbers it printed, and on what machine, are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from kvcli.engine.engine import Engine
from kvcli.io.documents import open_source
from kvcli.io.text import first_tokens
from kvcli.methods import make_method
from kvcli.models.load import load_model


def synchronize(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (CUDA runs asynchronously), so that the clock reads finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def stream_plain_blocks(model, ids: torch.Tensor, block: int, budget: int, *, warmup: int = 1,
                        before_timing=None) -> tuple[int, float]:
    """Stock forwards (SDPA attention) of ``block`` tokens against a ``DynamicCache`` cropped back to ``budget``
    tokens after every block: the tokens timed and the seconds they took.

    The first ``budget`` tokens fill the cache and ``warmup`` blocks run untimed; every later whole block is
    timed. Token ids and position ids live on the model's device (a GPU never waits on a host copy), and
    CUDA is synchronised before the clock is read. ``before_timing`` (e.g. a peak-memory reset) runs just
    before the clock starts.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = ids.to(device)
    positions = torch.arange(budget, budget + block, device=device)[None]
    model.set_attn_implementation("sdpa")
    try:
        past = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[None, :budget], past_key_values=past, use_cache=True, logits_to_keep=1)
            starts = range(budget, ids.shape[0] - block + 1, block)
            for start in starts[:warmup]:
                model(input_ids=ids[None, start:start + block], past_key_values=past, use_cache=True,
                      position_ids=positions)
                past.crop(-block)
            synchronize(device)
            if before_timing is not None:
                before_timing()
            started = time.perf_counter()
            done = 0
            for start in starts[warmup:]:
                model(input_ids=ids[None, start:start + block], past_key_values=past, use_cache=True,
                      position_ids=positions)
                past.crop(-block)  # back to `budget` tokens: the cost of the next block is what matters
                done += block
            synchronize(device)
        return done, time.perf_counter() - started
    finally:
        model.set_attn_implementation("kvcli")


def plain_blocks(model, ids: torch.Tensor, block: int, budget: int) -> float:
    """Tokens/s of stock forwards of ``block`` tokens against a DynamicCache cropped back to ``budget`` tokens."""
    done, seconds = stream_plain_blocks(model, ids, block, budget)
    return done / seconds if seconds > 0 else 0.0


def hf_sliding(model, ids: torch.Tensor, window: int, stride: int) -> tuple[float, float]:
    """Perplexity and tokens/s of the sliding-window loop in Hugging Face's perplexity guide."""
    ids = ids.to(next(model.parameters()).device)
    model.set_attn_implementation("sdpa")
    try:
        nll_sum, count, prev_end = 0.0, 0, 0
        started = time.perf_counter()
        with torch.inference_mode():
            for begin in range(0, ids.shape[0], stride):
                end = min(begin + window, ids.shape[0])
                chunk = ids[begin:end]
                logits = model(input_ids=chunk[None]).logits[0]
                first = max(prev_end - begin, 1)
                nll = F.cross_entropy(logits[first - 1:-1].float(), chunk[first:], reduction="sum")
                nll_sum += float(nll)
                count += chunk.shape[0] - first
                prev_end = end
                if end == ids.shape[0]:
                    break
        seconds = time.perf_counter() - started
        return math.exp(nll_sum / count), ids.shape[0] / seconds
    finally:
        model.set_attn_implementation("kvcli")


def plain_forward_ppl(model, ids: torch.Tensor) -> float:
    """Perplexity of one stock forward pass over all of ``ids``: the reference the engine must match."""
    ids = ids.to(next(model.parameters()).device)
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids[None]).logits[0]
        return math.exp(float(F.cross_entropy(logits[:-1].float(), ids[1:])))
    finally:
        model.set_attn_implementation("kvcli")


def _seconds_per_call(call, *args, repeats: int) -> float:
    call(*args)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        call(*args)
    return (time.perf_counter() - started) / repeats


def attention_timings(shapes=((256, 1024), (512, 1024), (256, 0), (1024, 0), (2048, 0), (6000, 0)), heads: int = 9,
                      kv_heads: int = 3, head_dim: int = 64, window: int = 32, repeats: int = 3,
                      dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Seconds per call of one layer's attention for ``(queries, cached keys)`` shapes, default-model heads:
    kvcli's explicit path against :func:`kvcli.kv.attention.sdpa_attention` (both also return the window)."""
    from kvcli.kv.attention import explicit_attention, sdpa_attention

    rows = []
    generator = torch.Generator().manual_seed(0)
    scaling = head_dim ** -0.5
    for queries, cached in shapes:
        keys = queries + cached
        q = torch.randn(1, heads, queries, head_dim, generator=generator).to(dtype)
        k = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
        v = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
        rows.append({"queries": queries, "cached": cached,
                     "explicit": _seconds_per_call(explicit_attention, q, k, v, scaling, window, repeats=repeats),
                     "sdpa": _seconds_per_call(sdpa_attention, q, k, v, None, scaling, window, repeats=repeats)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?")
    parser.add_argument("--attention", action="store_true", help="time one layer's attention paths and exit")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="streamingllm")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--cache", type=int, default=1024)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip", default="", help="comma-separated: plain-blocks,hf-sliding,plain-forward")
    args = parser.parse_args()
    if args.attention:
        from kvcli.models.load import resolve_dtype

        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        print(f"one layer's attention, {dtype}, {torch.get_num_threads()} threads")
        for row in attention_timings(dtype=dtype):
            print(f"queries {row['queries']:>5} cached {row['cached']:>5}  explicit {row['explicit'] * 1e3:8.2f} ms  "
                  f"sdpa {row['sdpa'] * 1e3:8.2f} ms")
        return
    if args.source is None:
        parser.error("give a SOURCE (or --attention)")

    loaded = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor(first_tokens(open_source(args.source), loaded.tokenizer, args.tokens + 1)[0])
    print(f"model {args.model} ({loaded.dtype}, {torch.get_num_threads()} threads), {ids.shape[0] - 1} tokens, "
          f"cache {args.cache}, block {args.block}")
    engine = Engine(loaded.model, make_method(args.method), args.cache, block=args.block)
    engine.score([ids[: 2 * args.block + 1].tolist()])  # warm-up
    totals = engine.score([ids.tolist()])
    print(f"engine {args.method:<14} {totals.tokens_per_second:8.0f} tokens/s  ppl {totals.ppl:.3f}")
    skip = set(args.skip.split(","))
    if "plain-blocks" not in skip:
        print(f"plain-blocks (sdpa)   {plain_blocks(loaded.model, ids, args.block, args.cache):8.0f} tokens/s")
    if "hf-sliding" not in skip:
        ppl, speed = hf_sliding(loaded.model, ids, args.cache, args.cache // 2)
        print(f"hf-sliding {args.cache}/{args.cache // 2}   {speed:8.0f} tokens/s  ppl {ppl:.3f}")
    trained = getattr(loaded.model.config, "max_position_embeddings", 0)
    if "plain-forward" not in skip and ids.shape[0] <= trained:
        ppl = plain_forward_ppl(loaded.model, ids)
        print(f"plain-forward         ppl {ppl:.4f}  (engine differs by {abs(totals.ppl / ppl - 1):.4%})")


if __name__ == "__main__":
    main()
