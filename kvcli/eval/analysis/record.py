"""Recording the attention of a sample of queries during one forward pass.

Attention is recorded by an attention function registered with transformers' ``AttentionInterface``
for one forward pass (no model class is patched): it computes the layer's output with kvcli's own
attention function and, beside it, the float32 attention distributions of a sample of queries (the
last ``queries`` ones). Only ``layers x heads x queries x tokens`` probabilities are kept, never a
layer's whole ``tokens x tokens`` map, so the sample grows linearly with the prompt (its size for the
default model is in docs/analysis.md, "How the attention is recorded").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvcli.kv.attention import block_causal_mask, kvcli_attention

RECORDING_ATTENTION = "kvcli-analysis"
RECORDER_KWARG = "kvcli_analysis"


@dataclass
class AttentionSample:
    """The attention of a sample of queries in every layer of one forward pass, and the values it weighs.

    ``probs[l]`` is ``[heads, queries, tokens]`` (float32, one row per sampled query, zero past the
    query's own position); ``values[l]`` is ``[kv_heads, tokens, head_dim]``; ``rows`` holds the
    positions of the sampled queries (ascending, the last one is the prompt's last token).
    """

    probs: list[torch.Tensor]
    values: list[torch.Tensor]
    rows: torch.Tensor

    @property
    def visible(self) -> torch.Tensor:
        """How many keys each sampled query sees (its position + 1): the support of its distribution."""
        return self.rows + 1


class AttentionRecorder:
    """Collects, layer by layer, what :func:`recording_attention` measures during one forward pass."""

    def __init__(self, rows: torch.Tensor, num_layers: int):
        self.rows = rows
        self.probs: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> None:
        self.probs[layer] = sampled_attention(query, key, scaling, self.rows.to(query.device)).cpu()
        self.values[layer] = value[0].detach().to("cpu", torch.float32)

    def sample(self) -> AttentionSample:
        if any(p is None for p in self.probs):
            raise RuntimeError("some layers did not run through the recording attention function")
        return AttentionSample(list(self.probs), list(self.values), self.rows.clone())


def sampled_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the queries at ``rows`` over all keys: ``[q_heads, len(rows), keys]`` in fp32.

    Recomputed in float32 from the layer's queries and keys (the model's own pass may run in bf16)
    so that entropies and divergences of near-zero probabilities are not rounding noise. Query
    head ``h`` reads KV head ``h // group``, the order of transformers' ``repeat_kv``.
    """
    q_heads, q_len = query.shape[1], query.shape[2]
    k_len = key.shape[2]
    group = q_heads // key.shape[1]
    keys = key[0].float().repeat_interleave(group, dim=0)
    logits = torch.matmul(query[0, :, rows].float(), keys.transpose(1, 2)) * scaling
    visible = block_causal_mask(q_len, k_len, query.device)[rows]
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def recording_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """kvcli's attention for the output, plus a record of the sampled queries' distributions.

    The recorder travels as a keyword argument of the forward call (as ``kvcli_cache`` does for the
    engine), so no global state is involved and the output is exactly what the model computes.
    """
    recorder: AttentionRecorder | None = kwargs.pop(RECORDER_KWARG, None)
    output = kvcli_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if recorder is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        recorder.record(module.layer_idx, query, key, value, scale)
    return output


def query_rows(length: int, queries: int) -> torch.Tensor:
    """Positions of the sampled queries: the last ``queries`` of the prompt (PoD's "last q tokens").

    The last queries all see nearly the whole prompt, so their entropies are comparable, and the
    very last one is the query TreeKV's wavelet analysis looks at.
    """
    queries = max(1, min(queries, length))
    return torch.arange(length - queries, length)


@torch.inference_mode()
def record_attention(model: torch.nn.Module, ids: torch.Tensor, queries: int = 64) -> AttentionSample:
    """Run ``ids`` ``[T]`` through the model once and record the attention of its last ``queries`` queries.

    The model's attention implementation is switched to :data:`RECORDING_ATTENTION` for this one
    pass and restored afterwards, whatever happens.
    """
    AttentionInterface.register(RECORDING_ATTENTION, recording_attention)
    recorder = AttentionRecorder(query_rows(ids.shape[0], queries), model.config.num_hidden_layers)
    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDING_ATTENTION)
    try:
        model.get_decoder()(input_ids=ids[None].to(device), use_cache=False, **{RECORDER_KWARG: recorder})
    finally:
        model.set_attn_implementation(previous)
    return recorder.sample()
