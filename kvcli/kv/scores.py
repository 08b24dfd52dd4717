"""The observation window's scores: the attention the last queries of a forward paid to every key.

Every attention path makes them here (:func:`window_probs`): from logits of queries scaled before the
matmul, softmaxed and summed in fp32. What a layer leaves is an :class:`~kvcli.kv.cache.AttentionRecord`,
which the method scores with after the forward (or, in a nested forward, right after the layer).

On the SDPA path, which every GPU block takes, a layer's window is a matmul of its own, and its mask,
softmax and sum are more operations in every layer. A GPU block is host-bound (each operation is a
launch: docs/benchmarks.md), so those three wait: the layer leaves its window's logits with the cache
(:func:`defer`), and :func:`settle` softmaxes and sums every layer of the forward whose logits have the
same shape as one batch, before anything reads the records. Each layer's scores are exactly what it
would have computed alone. Only small windows wait (:data:`DEFER_SCORES`): a long one (H2O scores
every query of a block) is summed at once, in chunks, as the attention path did before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.kv.cache import AttentionRecord, CompressedLayer, KVCache

#: Largest window (query heads x queries x keys) whose logits wait for :func:`settle`: 2^22 bf16 logits
#: are 8 MiB a layer, so a forward's waiting windows stay small beside the cache they score.
DEFER_SCORES = 1 << 22
#: Most logits :func:`settle` stacks at once (their fp32 softmax is 64 MiB): more layers go in several batches.
STACK_SCORES = 1 << 24


def window_probs(logits: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Softmax of the window's scaled ``logits`` ``[..., w, keys]``, summed over the ``w`` queries;
    ``hidden`` ``[w, m]`` marks which of the last ``m`` keys (the block's own) each query must not see: every
    cached key before them is visible to all (None: the logits are masked already). With a mask, the logits
    are masked in place (the caller's own tensor).

    The softmax reads the logits in their own dtype and computes in fp32 (no fp32 copy of the logits first),
    so that bf16 rounding of the probabilities never turns near-equal scores into exact ties (which the
    eviction rules break to the left) on one device and not on another.
    """
    if hidden is not None:
        logits[..., logits.shape[-1] - hidden.shape[-1]:].masked_fill_(hidden, float("-inf"))
    return torch.softmax(logits, dim=-1, dtype=torch.float32).sum(dim=-2)


def record(layer: CompressedLayer, probs: torch.Tensor, window: int, probing: bool, question: bool,
           skip: int = 0) -> None:
    """Leave the window's ``probs`` ``[H_kv, group, keys]`` as ``layer``'s record.

    ``probing``: the queries were a probe's (the question alone scores, and its own keys are not kept);
    ``question``: the recorded queries are the question's (:attr:`KVCache.question_scores`); ``skip``: how many
    of the forward's last queries came after the recorded ones (:attr:`AttentionRecord.skip`).
    """
    if probing:  # the block the probe follows recorded nothing (Engine.forward); the probe's keys are not kept
        probe = probs[..., : layer.get_seq_length()]
        layer.record = AttentionRecord(probe, window, probe, own=0)
    else:
        layer.record = AttentionRecord(probs, window, probs if question else None, skip=skip)


@dataclass
class Waiting:
    """A layer's window logits ``[H_kv, group, w, keys]`` waiting for their softmax, and how to record them."""

    layer: CompressedLayer
    logits: torch.Tensor
    hidden: torch.Tensor | None
    window: int
    probing: bool
    question: bool
    skip: int = 0

    def batch_key(self) -> tuple:
        # Within one forward every layer's window has the same queries, so equal shapes mean equal masks.
        return (self.logits.shape, self.logits.dtype, self.logits.device,
                None if self.hidden is None else self.hidden.shape)


def defers(heads: int, window: int, keys: int) -> bool:
    """Whether a window of ``window`` queries of ``heads`` heads over ``keys`` keys may wait for :func:`settle`."""
    return heads * window * keys <= DEFER_SCORES


def defer(cache: KVCache, layer: CompressedLayer, logits: torch.Tensor, hidden: torch.Tensor | None,
          window: int, skip: int = 0) -> None:
    """Leave ``layer``'s window logits with ``cache`` until :func:`settle` (the caller settles before reading)."""
    cache.waiting.append(Waiting(layer, logits, hidden, window, cache.probing, cache.question_scores, skip))


def settle(cache: KVCache) -> None:
    """Record every waiting window: the logits of equal shape stacked, masked, softmaxed and summed as one."""
    waiting, cache.waiting = cache.waiting, []
    groups: dict[tuple, list[Waiting]] = {}
    for item in waiting:
        groups.setdefault(item.batch_key(), []).append(item)
    for alike in groups.values():
        per_batch = max(1, STACK_SCORES // alike[0].logits.numel())
        for start in range(0, len(alike), per_batch):
            items = alike[start:start + per_batch]
            first = items[0]
            if len(items) == 1:
                probs: tuple[torch.Tensor, ...] = (window_probs(first.logits, first.hidden),)
            else:
                probs = window_probs(torch.stack([item.logits for item in items]), first.hidden).unbind(0)
            for item, layer_probs in zip(items, probs, strict=True):
                record(item.layer, layer_probs, item.window, item.probing, item.question, item.skip)
