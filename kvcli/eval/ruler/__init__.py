"""RULER's synthetic tasks (Hsieh et al., 2024), built offline from a book, read as ``kvcli ask`` reads.

The tasks, templates, needle types and answer prefixes are RULER's (NVIDIA's ``scripts/data/synthetic/`` as
lm-eval 0.4.13 ships them in ``lm_eval/tasks/ruler``): needle in a haystack with one key or several, several
values or several queries, variable tracking (vt), common words (cwe) and frequent words extraction (fwe). What
needs a download in RULER comes from the book the user gives instead (docs/ruler.md): the essay haystack is the
book's text with the needles put in at sentence ends, and the words of keys and of cwe's list are the book's own.
Every sample is sized with the model's tokenizer: the whole prompt as ``kvcli ask`` builds it (chat template, the
question's frame) plus RULER's room for the answer fills the target length. A sample's draws come from its seed,
task, length and index only, so each sample is the same whatever else a run asks for.

A trial is ``kvcli ask DOCUMENT QUESTION --answer-prefix PREFIX``: the document is the task's text up to and
with the context, the question is RULER's question after it, and RULER's answer prefix starts the answer. Its
score is RULER's ``string_match_all`` (the share of expected values the answer holds) under kvcli's whole-token
rule (:func:`found`).

The package's modules: :mod:`~kvcli.eval.ruler.tasks` (the tasks, a sample drawn and sized),
:mod:`~kvcli.eval.ruler.grading` (the score), :mod:`~kvcli.eval.ruler.trials` (a run, its rows),
:mod:`~kvcli.eval.ruler.export` (the samples for kvpress) and :mod:`~kvcli.eval.ruler.plot`.
"""

from __future__ import annotations

from kvcli.eval.ruler.export import export_samples, template_digest
from kvcli.eval.ruler.grading import found, recall
from kvcli.eval.ruler.tasks import TASKS, Book, Sample, Task, make_sample
from kvcli.eval.ruler.trials import Reading, RulerLog, RulerResult, Trial, check_ratios, kept_tokens, run_ruler

__all__ = ["TASKS", "Book", "Reading", "RulerLog", "RulerResult", "Sample", "Task", "Trial", "check_ratios",
           "export_samples", "found", "kept_tokens", "make_sample", "recall", "run_ruler", "template_digest"]
