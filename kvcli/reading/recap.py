"""The recap of a streamed read with a question: the passages the question pointed at, read once more.

Beyond the papers (an ``ask`` reading choice, not a method). While a long document streams past a
compressed cache, the question's probe attends to every block as it arrives. :class:`Recap` notes, per
block, the tokens that the question's queries single out in the middle layers, and keeps the best few
of them with ``radius`` neighbours on each side: token ids, a bounded number, never keys or values.
After the document the reader streams those passages once more before the question: the document's
opening first, then the others from the least to the most pointed-at (:func:`best_last`). Re-read, they enter
every layer and head of the cache with the context of their passage, where compression may have kept them in a
few heads only (the measurements are in
docs/notes/2026-11-26-ask-recap.md).
Gathering the relevant tokens and recomputing their keys and values is the idea of REFORM (Song et al.,
2025, "Compress, Gather, and Recompute"); the scores here are the method's own probe attention, so a
method that scores nothing (StreamingLLM) gets no recap.

The rules, and why:

* A token's score is the largest share of a block that one query head of the middle layers (from a
  third to five sixths of the depth) pays the passage around it, summed over the question's queries. The share is
  taken over the block's own tokens, so every token is scored once, at first sight, against the same
  question, and blocks compare; the bottom layers' question attention is spread or goes to frequent
  words, the top layers' to the answer's format (docs/notes/2026-11-25-ask-24k-streamed.md, where a lost key survives).
* The passage's share weighs its tokens by their nearness, from 1 at the token to ``1 / (radius + 1)`` at the
  radius's edge: what the question names spans several tokens (a name, a key and the words before it), while
  some heads rest on one token wherever it appears (Gemma 3 on every "’"), and one token alone outscored the needle
  (docs/notes/2026-12-05-recap-passage-share.md). Nearness weighs the token itself most, so a passage centres on
  its best token.
* A peak is the best token within ``radius`` of it, so passages do not repeat one another.
* A peak's score rises by :data:`PAIR_BONUS` for every pair of the question's own consecutive tokens that begins in
  its passage and at most :data:`RARE_PAIR` times in the block, weighed by nearness: among needles that look alike
  the question's attention finds needles, not the asked key, while a key or name the question gives is rare where
  a phrase every needle repeats is not. Only peaks rise, so a passage stays centred where the attention put it: a
  passage centred on the key can end before the value asked for (docs/notes/2026-12-06-recap-question-pairs.md).
* The block's last ``radius`` tokens are never peaks: the probe sits right after them, and nearness
  alone draws its attention there. This also gives every peak its right-hand neighbours within its
  block; the left-hand ones may come from the block before.
* A passage ends and begins between words: it reaches up to ``reach`` more tokens to finish a word cut by
  its radius, or else gives up the cut word (never the peak): a number cut short teaches the model a wrong
  number, and two pieces of one uuid read back to back make a wrong uuid (docs/reading.md). Two tokens join
  into one word when the first ends and the second begins with a letter, a digit or a hyphen, read from the
  pair decoded together (a SentencePiece tokenizer drops the space of a token decoded alone). A uuid is one
  word, 36 tokens in SmolLM2's and Gemma 3's tokenizers (a character a token; Llama 3's groups digits).
* The best passage is read last, nearest the question: a small model answers from the passage nearest the
  question, and RULER's multi-key needles look alike, so in stream order Gemma 3 270M answered a later
  distractor's value though the recap held the asked needle and ranked it higher. A passage within the document's
  first passage width (a title, a heading, an instruction) stays first, where it frames what follows: read last,
  RULER's "A special magic uuid is hidden within the following" was continued instead of answered
  (docs/notes/2026-12-06-recap-best-last.md). Each run of neighbouring passages keeps its stream order.
* The recap and the question end the last block, and a scored method keeps that block whole with the
  question (:attr:`kvcli.kv.cache.LayerView.held`): the recap was read so that every layer and head holds what
  the question pointed at, and the question's queries alone would let a top layer drop part of it again.
* Scores, peaks and passages stay on the device until the recap is asked for, so the block loop
  never waits on the host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads the defaults below without it
    import torch

#: What ``kvcli ask`` re-reads at most by default: half the default cache of 1,024 (docs/notes/2026-11-26-ask-recap.md).
RECAP_TOKENS = 512
#: What an answer from a read made without its question re-reads at most by default (:mod:`kvcli.reading.recall`;
#: chosen on the tuning haystack, docs/notes/2026-11-29-recall-exact-keys.md).
RECALL_TOKENS = 256
#: Tokens each side of a peak that its passage keeps: a short sentence around a word the question finds.
RADIUS = 8
#: Tokens past its radius a passage may take on each side to finish a word: a uuid (36 tokens) from a peak on its
#: first character (docs/notes/2026-11-29-recap-whole-uuids.md).
REACH = 32
#: Stored ids: outside the document (its edge is a word boundary), and past the block (not known yet).
OUTSIDE, UNSEEN = -1, -2
#: What a rare pair of the question's own tokens adds to the score of a peak whose passage it begins in, weighed by
#: nearness: more than any attention share (at most 1), so a passage that names what the question names outranks
#: its lookalikes.
PAIR_BONUS = 1.0
#: A pair of the question's tokens is rare in a block where it begins at most this often: a name or a key, not a
#: phrase every needle or sentence repeats ("special magic", "in the").
RARE_PAIR = 2


def word_joins(tokenizer) -> Callable[[int, int], bool]:
    """Whether two token ids, in this order, are one word: the first's text ends and the second's begins with a
    letter, digit or hyphen ("6" "0" in "60494", "swe" "pt", "8" "-" "2" in a uuid), as opposed to " key" after
    "pass" or "." after "4". The second's first character is read from the pair decoded together, since a
    SentencePiece tokenizer drops a token's leading space when it is decoded alone."""

    @cache
    def text(*ids: int) -> str:
        return tokenizer.decode(list(ids), clean_up_tokenization_spaces=False)

    def inside(char: str) -> bool:
        return char.isalnum() or char == "-"

    def joins(first: int, second: int) -> bool:
        head, pair = text(first), text(first, second)
        after = pair[len(head):len(head) + 1] if pair.startswith(head) else text(second)[:1]
        return inside(head[-1:]) and inside(after)

    return joins


def question_pairs(question: Sequence[int]) -> frozenset[tuple[int, int]]:
    """The pairs of consecutive token ids of the question's own words: what a passage that names what the question
    names shares with it."""
    return frozenset(zip(question, question[1:], strict=False))


def rare_pair_starts(ids: Sequence[int], pairs: frozenset[tuple[int, int]], rare: int = RARE_PAIR) -> list[float]:
    """1.0 at each token of ``ids`` where a pair of ``pairs`` begins that begins at most ``rare`` times in ``ids``,
    else 0.0: counted on the host from the block's ids, which the host already holds."""
    if not pairs:
        return [0.0] * len(ids)
    found = [pair if pair in pairs else None for pair in zip(ids, ids[1:], strict=False)]
    counts = Counter(pair for pair in found if pair is not None)
    return [1.0 if pair is not None and counts[pair] <= rare else 0.0 for pair in found] + [0.0] * bool(ids)


def passage_share(share: torch.Tensor, radius: int) -> torch.Tensor:
    """``share`` (``[..., tokens]``) summed over each token's passage, weighed by nearness: 1 at the token, less
    by ``1 / (radius + 1)`` a step, so ``1 / (radius + 1)`` at the radius's edge."""
    import torch

    steps = torch.arange(-radius, radius + 1, device=share.device, dtype=share.dtype).abs()
    weights = (1 - steps / (radius + 1)).view(1, 1, -1)
    flat = share.reshape(-1, 1, share.shape[-1])
    return torch.nn.functional.conv1d(flat, weights, padding=radius).view(share.shape)


def passage_width(radius: int = RADIUS) -> int:
    """Tokens in one passage, a peak and ``radius`` neighbours on each side: the least a recap holds."""
    return 2 * radius + 1


def recap_room(recap: int, budget: int | None) -> int:
    """The recap's tokens at most: ``recap``, and no more than half the ``budget``, since the recap is held with the
    question within the layer and one the size of the cache would leave the read no room; 0 when that is less
    than one passage."""
    room = recap if budget is None else min(recap, budget // 2)
    return room if room >= passage_width() else 0


def scored_layers(num_layers: int) -> range:
    """The middle layers whose question attention scores the recap: from a third to five sixths of the depth."""
    return range(num_layers // 3, 5 * num_layers // 6 + 1)


def stream_order(chosen: dict[int, int]) -> list[int]:
    """The token ids of ``chosen`` (stream index -> id, :meth:`Recap.chosen`) in stream order."""
    return [chosen[index] for index in sorted(chosen)]


def consecutive_runs(indices: Iterable[int]) -> list[list[int]]:
    """``indices`` as runs of consecutive numbers, in order: the passages a recap or recall reads whole."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def best_last(chosen: dict[int, int], opening: int = 0) -> list[int]:
    """The token ids of ``chosen`` (stream index -> id, best passages first, :meth:`Recap.chosen`) as runs of
    consecutive stream indices, each in stream order: first the runs that begin before stream index ``opening``
    (the document's opening, a title or an instruction, which frames what follows and which a small model
    continues if it stands right before the question), then the others from the least to the most pointed-at (a
    run ranks as its best passage), so the passage the question found most lies nearest the question, where a
    small model looks for its answer among lookalikes (docs/notes/2026-12-06-recap-best-last.md)."""
    rank = {index: n for n, index in enumerate(chosen)}
    runs = consecutive_runs(chosen)
    head = [run for run in runs if run[0] < opening]
    rest = sorted((run for run in runs if run[0] >= opening), key=lambda run: min(rank[i] for i in run), reverse=True)
    return [chosen[index] for run in head + rest for index in run]


class Recap:
    """At most ``tokens`` token ids of the document that the question pointed at, in stream order.

    Feed every streamed block with :meth:`observe` while its attention records are alive (the engine's
    ``observe`` hook), then take :meth:`passages`. ``first`` is the first stream index that may be
    recapped (the document's start: the chat template's prefix is never repeated). ``question``: the question's own
    token ids (without the prompt's frame), whose rare pairs raise the peaks that hold them.
    """

    def __init__(self, tokens: int, radius: int = RADIUS, first: int = 0, reach: int = REACH,
                 question: Sequence[int] = ()):
        self.width = passage_width(radius)
        self.pairs = question_pairs(question)
        if radius < 0 or reach < 0 or tokens < self.width:
            raise ValueError(f"a recap holds at least one passage of {self.width} tokens, not {tokens}")
        self.tokens, self.radius, self.first, self.reach = tokens, radius, first, reach
        self.side = radius + reach + 1  # stored ids each side of a peak: one more shows where a word began
        # Peaks are at least ``radius + 1`` apart, so their passages overlap by at most half: twice the
        # passages that fit side by side are enough to fill the recap.
        self.slots = max(1, 2 * tokens // (radius + 1))
        self.scores: torch.Tensor | None = None  # [slots] best first
        self.starts: torch.Tensor | None = None  # [slots] stream index of each passage's first token
        self.ids: torch.Tensor | None = None  # [slots, 2 * side + 1] token ids, OUTSIDE / UNSEEN
        self.tail: torch.Tensor | None = None  # the previous block's last ``side`` ids

    def observe(self, cache, ids: list[int], start: int) -> None:
        """Score the block ``ids`` (stream indices from ``start``) by the question's attention recorded in
        ``cache``'s layers, and keep its best passages among those seen so far."""
        import torch

        n = len(ids)
        share = self._block_share(cache, n)
        device = share.device if share is not None else torch.device("cpu")
        block = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
        side = self.side
        tail, self.tail = self.tail, block[max(n - side, 0):]
        if share is None:
            return
        left = block.new_full((side,), OUTSIDE)  # the passages' left neighbours from the block before
        if tail is not None and tail.numel():
            left[side - tail.numel():] = tail.to(device)
        ext = torch.cat((left, block, block.new_full((side,), UNSEEN)))
        share = torch.cat((share, share.new_full((n - share.numel(),), -1.0)))  # the last radius: no peaks
        share = share.masked_fill(start + torch.arange(n, device=device) < self.first, -1.0)
        # Peaks only: a token below the best within ``radius`` of it would repeat most of that one's passage.
        nearby = torch.nn.functional.max_pool1d(share[None, None], self.width, stride=1, padding=self.radius)[0, 0]
        share = share.masked_fill(share < nearby, -1.0)
        share = self._named(share, ids)
        top = share.topk(min(self.slots, n))
        offsets = torch.arange(2 * side + 1, device=device)
        passage = ext[top.indices[:, None] + offsets]  # into ext: peak - side ...
        first = start + top.indices - side
        passage = passage.masked_fill(first[:, None] + offsets < self.first, OUTSIDE)
        if self.scores is None:
            scores, starts, kept = top.values, first, passage
        else:
            scores = torch.cat((self.scores, top.values))
            starts = torch.cat((self.starts, first))
            kept = torch.cat((self.ids, passage))
        best = scores.topk(min(self.slots, scores.numel()))
        self.scores, self.starts, self.ids = best.values, starts[best.indices], kept[best.indices]

    def _block_share(self, cache, n: int) -> torch.Tensor | None:
        """``[n - radius]``: each block token's largest passage share of the block (its last ``radius`` tokens left
        out) paid by one query head of the middle layers, the question's queries summed; None when no layer
        recorded the question's attention or the block is no longer than ``radius``."""
        import torch

        best = None
        if n <= self.radius:
            return None
        for i in scored_layers(len(cache.layers)):
            layer = cache.layers[i]
            record = getattr(layer, "record", None)
            if record is None or record.probe is None or layer.window is not None:
                continue
            # The block is each head's last n tokens before compression.
            probs = record.probe[..., -n:-self.radius if self.radius else None].float()
            share = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
            share = passage_share(share, self.radius).amax(dim=(0, 1))
            best = share if best is None else torch.maximum(best, share)
        return best

    def _named(self, share: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """``share`` with each peak raised by :data:`PAIR_BONUS` for every rare pair of the question's tokens that
        begins in its passage, weighed by nearness as the share is. The peaks stay where the attention put them: a
        passage centred on the key the question names can end before the value it asks for."""
        if not self.pairs:
            return share
        import torch

        hits = torch.tensor(rare_pair_starts(ids, self.pairs), dtype=share.dtype).to(share.device, non_blocking=True)
        named = passage_share(hits[None, None], self.radius)[0, 0]
        return torch.where(share >= 0, share + PAIR_BONUS * named, share)

    def in_reading_order(self, chosen: dict[int, int]) -> list[int]:
        """``chosen``'s token ids as the reader reads them (:func:`best_last`): a run that begins within the
        document's first passage width is its opening."""
        return best_last(chosen, self.first + self.width)

    def passages(self, joins: Callable[[int, int], bool] | None = None) -> list[int]:
        """The recap's token ids in stream order (:meth:`chosen`'s)."""
        return stream_order(self.chosen(joins))

    def chosen(self, joins: Callable[[int, int], bool] | None = None) -> dict[int, int]:
        """The recap's token ids by stream index: the best passages first, as many as fit ``tokens``
        (a passage that would overflow it is left out), overlapping passages merged. ``joins``
        (:func:`word_joins`) moves each passage's ends to word boundaries; without it a passage is its peak
        and ``radius`` tokens each side."""
        if self.scores is None:
            return {}
        scores, starts, ids = self.scores.tolist(), self.starts.tolist(), self.ids.tolist()
        chosen: dict[int, int] = {}
        for score, start, span in zip(scores, starts, ids, strict=True):
            if score <= 0:
                break  # masked tokens and later ones: no peak left
            lo, hi = self._edges(span, joins)
            new = {start + j: span[j] for j in range(lo, hi) if span[j] >= 0 and start + j not in chosen}
            if len(chosen) + len(new) > self.tokens:
                continue
            chosen.update(new)
        return chosen

    def _edges(self, span: list[int], joins: Callable[[int, int], bool] | None) -> tuple[int, int]:
        """Where a stored passage (its peak at ``side``) begins and ends (exclusive) between words: its radius
        stretched by up to ``reach`` tokens to the word boundary beyond it, else pulled in to the boundary
        within it (never past the peak), else left where the radius puts it."""
        peak = self.side
        lo, hi = peak - self.radius, peak + self.radius + 1
        if joins is None:
            return lo, hi

        def cut(i: int) -> bool | None:  # a boundary between span[i - 1] and span[i]; None: not known
            before, after = span[i - 1], span[i]
            if OUTSIDE in (before, after):
                return True
            if UNSEEN in (before, after):
                return None
            return not joins(before, after)

        # The first boundary outward, else the first inward (towards the peak), else the radius's edge.
        start = next((i for i in chain(range(lo, 0, -1), range(lo + 1, peak + 1)) if cut(i)), lo)
        end = next((i for i in chain(range(hi, len(span)), range(hi - 1, peak, -1)) if cut(i)), hi)
        return start, end
