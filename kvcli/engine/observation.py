"""What a forward observes for the method: which queries record their attention, and which of the block's
tokens are the question the method must keep.

Planned apart from the forward that runs it (:meth:`kvcli.engine.engine.Engine.forward`), as a pure function of
the method and the forward's arguments, so the rule reads in one place:

* A probe (query tokens that score the cache without entering it: a question streamed alongside the block)
  is the question; its queries alone are recorded, all of them, whatever the method's own window.
* Without a probe, ``question`` says the block's own last ``question`` tokens are the question (the end of a
  prompt read in one shot, or the last block of a streamed read): those queries alone are recorded, and the
  text's last queries do not vote (FINCH's rule for streamed chunks; in a one-shot read, SnapKV's window sized
  to the question).
* ``held`` (at least ``question``) says the block's last ``held`` tokens stay in every layer whatever they
  score, as the question does (:attr:`kvcli.kv.cache.LayerView.held`).
* ``span`` narrows the question to its own words: of the question's tokens (the probe's, or the block's last
  ``question``), only ``span = (start, end)`` record their attention; the frame before them and the chat
  template's tail after them (``skip``) still attend and are still kept, but do not vote.
* A method that scores nothing (StreamingLLM), or a forward that does not compress, records nothing and
  knows no question.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcli.methods.base import Method


@dataclass(frozen=True)
class Observation:
    """What one forward records and protects (:func:`plan_observation`)."""

    window: int  # how many of the block's last queries record their attention (KVCache.score_window)
    question: int  # the block's last tokens that are the question (LayerView.question)
    held: int  # the block's last tokens kept whatever they score (LayerView.held)
    asks: bool  # the recorded queries are the question's, a probe's or the block's own (KVCache.question_scores)
    skip: int = 0  # the block's last tokens after the recorded queries, which do not vote (KVCache.score_skip)


def plan_observation(method: Method, length: int, compressing: bool, probed: bool, question: int = 0,
                     held: int = 0, span: tuple[int, int] | None = None) -> Observation:
    """The observation of a forward of ``length`` tokens that compresses (``compressing``) with ``method``, with a
    probe (``probed``) or the block's last ``question`` tokens as the question (of which ``span`` votes) and its
    last ``held`` kept."""
    scores = method.score_window(length) if compressing else 0
    question = min(question, length) if scores and not probed else 0  # with a probe, the probe is the question
    held = max(min(held, length), question) if question else 0
    asks = scores > 0 and (probed or question > 0)
    if not asks:
        return Observation(scores, question, held, asks)
    window, skip = voters(span, question) if question else (0, 0)  # a probe's: Engine.forward, by its length
    return Observation(window, question, held, asks, skip)


def voters(span: tuple[int, int] | None, length: int) -> tuple[int, int]:
    """Of a question of ``length`` tokens, how many record their attention and how many after them do not:
    ``span``'s tokens, or all of them without a span (or with one that does not fit)."""
    if span is None or not 0 <= span[0] < span[1] <= length:
        return length, 0
    return span[1] - span[0], length - span[1]
