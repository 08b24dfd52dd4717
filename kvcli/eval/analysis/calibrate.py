"""PoD calibration: find, per KV head, the consecutive layers whose attention is alike (PoD section 2.1).

Algorithm (the paper's, with its appendix B.2 settings where this model allows them):

1. Sample ``samples`` (N) sequences of ``length`` tokens from the documents (Eq. 1's inputs).
2. Run each through the model once and record, in every layer and query head, the attention
   distributions of its last ``q`` queries (:func:`kvcli.eval.analysis.record_attention`, float32).
3. ``sim_h(a, b) = 1 - mean over the N x q distributions of JS(S^a, S^b)`` (Eq. 2, base-2 JS so the
   similarity runs from 0 to 1), per query head.
4. Two layers are similar for a KV head when a strict majority of its query heads have
   ``sim_h >= threshold`` (appendix B.2's vote for GQA), and Algorithm 1 merges consecutive layers
   bottom-up while each is similar to every layer of the current block.

The paper samples 1,000 sequences of 32K tokens from Dolma and looks at the last 16 queries. The
defaults here (16 sequences of 2,048 tokens, q = 16) finish in a couple of minutes on two CPU cores
for SmolLM2-135M; docs/methods.md records the command that produced the shipped groups.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import torch

from kvcli.errors import UsageError
from kvcli.methods.pod.groups import GroupsFile, ModelShape, check_threshold, groups_from_similarity

DEFAULT_SAMPLES = 16
DEFAULT_LENGTH = 2048
DEFAULT_Q = 16
DEFAULT_THRESHOLD = 0.5
#: Sequences are drawn from the first ``SPREAD x (samples of the document) x length`` tokens of each
#: document, one per equal slice at a random offset, so that samples do not overlap and a long book is
#: not tokenized whole.
SPREAD = 4


def sample_sequences(documents: Iterable, tokenizer, samples: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """``samples`` token sequences of ``length`` tokens, spread over the documents (seeded, non-overlapping).

    Documents take turns (sample i comes from document ``i mod D``); within a document the samples
    sit in equal slices of its first ``SPREAD x k x length`` tokens, each at a random offset.
    Documents shorter than ``length`` tokens are skipped.
    """
    from kvcli.io.text import first_tokens

    docs = list(documents)
    if samples < 1 or length < 2:
        raise UsageError("calibration needs at least one sample of at least 2 tokens")
    if not docs:
        raise UsageError("calibration needs at least one document")
    rng = random.Random(seed)
    wanted = [samples // len(docs) + (1 if i < samples % len(docs) else 0) for i in range(len(docs))]
    out: list[torch.Tensor] = []
    for doc, count in zip(docs, wanted, strict=True):
        if count == 0:
            continue
        ids, _ = first_tokens([doc], tokenizer, SPREAD * count * length)
        if len(ids) < length:
            continue
        count = min(count, len(ids) // length)
        width = len(ids) // count
        for k in range(count):
            start = k * width + rng.randrange(0, width - length + 1)
            out.append(torch.tensor(ids[start:start + length], dtype=torch.long))
    if not out:
        raise UsageError(f"no document has {length} tokens: lower the tokens per sample or add text")
    return out


@torch.inference_mode()
def similarity_of(model: torch.nn.Module, sequences: list[torch.Tensor], q: int,
                  on_sample: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Eq. 2 averaged over the sequences: ``[heads, layers, layers]`` float64, ``1 - mean JS`` per query head.

    Every sequence contributes its last ``q`` queries with equal weight, so the mean of the
    per-sequence similarities is the paper's mean over all ``N x q`` distributions.
    """
    from kvcli.eval.analysis import layer_similarity, record_attention  # the package's top level, not its modules

    total: torch.Tensor | None = None
    for i, ids in enumerate(sequences):
        sample = record_attention(model, ids, q)
        sim = layer_similarity(sample.probs)
        total = sim if total is None else total + sim
        del sample
        if on_sample:
            on_sample(i + 1, len(sequences))
    assert total is not None
    return total / len(sequences)


def calibrate(model: torch.nn.Module, tokenizer, documents: Iterable, threshold: float = DEFAULT_THRESHOLD,
              q: int = DEFAULT_Q, n: int = DEFAULT_SAMPLES, length: int = DEFAULT_LENGTH, *, seed: int = 0,
              model_id: str = "", source: str = "",
              on_sample: Callable[[int, int], None] | None = None) -> GroupsFile:
    """PoD's offline exploration (Algorithm 1) for ``model``: the head-wise layer groups as a :class:`GroupsFile`.

    ``n`` sequences of ``length`` tokens from ``documents`` (:class:`kvcli.io.documents.Document`), the last
    ``q`` queries of each, similarity threshold ``threshold``. ``on_sample(done, total)`` reports
    progress. Save the result with :meth:`GroupsFile.save` and pass it as ``-o groups=FILE``.
    """
    check_threshold(threshold)
    if q < 1:
        raise UsageError(f"q must be at least 1, not {q}")
    trained = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if trained and length > trained:
        raise UsageError(f"{length} tokens per sample is past the model's trained context of {trained}")
    sequences = sample_sequences(documents, tokenizer, n, length, seed)
    sim = similarity_of(model, sequences, min(q, length), on_sample)
    shape = ModelShape.of(model.config)
    groups = groups_from_similarity(sim, shape.kv_heads, threshold)
    rounded = [[[round(float(v), 4) for v in row] for row in head] for head in sim]
    return GroupsFile(model_id or str(getattr(model.config, "_name_or_path", "")), shape, groups, threshold,
                      min(q, length), len(sequences), length, seed, source, rounded)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcli.eval.analysis.calibrate SOURCE... --out FILE``: calibrate and save
    (until a CLI command exists)."""
    import argparse
    import sys
    import time

    from kvcli.errors import KvcliError
    from kvcli.io.documents import open_source
    from kvcli.models.load import DEFAULT_MODEL, load_model

    parser = argparse.ArgumentParser(prog="python -m kvcli.eval.analysis.calibrate", description=calibrate.__doc__)
    parser.add_argument("sources", nargs="+", help="text files or folders of .txt files")
    parser.add_argument("--out", required=True, help="groups file to write (JSON)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    parser.add_argument("--q", type=int, default=DEFAULT_Q, help="last queries per sample")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="N sampled sequences")
    parser.add_argument("--tokens", type=int, default=DEFAULT_LENGTH, help="tokens per sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        documents = [doc for source in args.sources for doc in open_source(source)]
        loaded = load_model(args.model)
        started = time.perf_counter()
        groups = calibrate(loaded.model, loaded.tokenizer, documents, args.threshold, args.q, args.samples,
                           args.tokens, seed=args.seed, model_id=args.model,
                           source=", ".join(doc.name for doc in documents),
                           on_sample=lambda done, total: print(f"\r{done}/{total} samples", end="", file=sys.stderr))
        print(file=sys.stderr)
        groups.notes["seconds"] = round(time.perf_counter() - started, 1)
        groups.save(args.out)
    except KvcliError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: blocks per KV head {groups.blocks_per_kv_head()}, theoretical KV saving "
          f"{groups.theoretical_kv_saving():.1%} ({groups.notes['seconds']} s)")


if __name__ == "__main__":
    main()
