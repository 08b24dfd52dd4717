"""Time the recall's page scoring of one layer and KV head over T tokens spilled to disk, as a question at T tokens
does it once per layer and KV head (:func:`kvcli.reading.recall._page_shares`, two passes over the spill).

Random keys, 30 queries (ten question tokens, three query heads a KV head, as SmolLM2-135M), 20,000 distinct words.
Run alone on the machine: ``OMP_NUM_THREADS=1 python docs/results/recall_scoring_bench.py 1000000``.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from kvcli.reading.keystore import KeyStore
from kvcli.reading.recall import CHUNK, PAGE, _page_shares


def main(tokens: int, dim: int = 64, queries: int = 30, words: int = 20000, block: int = 1024) -> None:
    torch.manual_seed(0)
    keys = torch.randint(-127, 128, (tokens, dim), dtype=torch.int8)
    scales = (torch.rand(tokens) * 0.05 + 0.01).half()
    query = torch.randn(queries, dim) * 2
    word = torch.randint(0, words, (tokens,))
    with tempfile.TemporaryDirectory() as folder:
        store = KeyStore.spill(1, 1, dim, folder)
        for at in range(0, tokens, block):
            store.append(keys[at:at + block].view(-1, 1, 1, dim), scales[at:at + block].view(-1, 1, 1))
        whole = tokens // PAGE * PAGE
        for _ in range(3):
            started = time.perf_counter()
            _page_shares(query, lambda: store.pieces(0, 0, whole, CHUNK), PAGE, word[:whole])
            print(f"{tokens:,} tokens: {time.perf_counter() - started:.3f} s for one layer and KV head")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)
