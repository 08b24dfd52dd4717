"""A decode step's attention products at the 8B shape, by the number of slots they run over (issue #56).

    python docs/results/decode_alignment.py

For each slot count T: microseconds of one layer's two products (8 KV heads with 4 query heads each, head 128:
the query's logits ``[1, 8, 4, 128] x [1, 8, 128, T]``, then the probabilities times the values
``[1, 8, 4, T] x [1, 8, T, 128]``), 32 of them captured in a CUDA graph and replayed. The static steps' buffers
held ``budget + 1`` slots (1,025; StreamingLLM's ring 1,021) before they were padded to a multiple of 64.
"""

from __future__ import annotations

import json

import torch


def micros(slots: int) -> float:
    query = torch.randn(1, 8, 4, 128, dtype=torch.bfloat16, device="cuda")
    keys = torch.randn(32, 1, 8, slots, 128, dtype=torch.bfloat16, device="cuda")
    values = torch.randn_like(keys)

    def layers() -> None:
        for i in range(32):
            probs = torch.matmul(query, keys[i].transpose(2, 3)).softmax(-1)
            torch.matmul(probs, values[i])

    layers()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 50 / 32


if __name__ == "__main__":
    for slots in (1021, 1024, 1025, 1090, 1088, 1152):
        print(json.dumps({"slots": slots, "us_per_layer": round(micros(slots), 2)}), flush=True)
