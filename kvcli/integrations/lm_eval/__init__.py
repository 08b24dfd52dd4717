"""kvcli inside lm-evaluation-harness: the model ``kvcli``, whose every request runs through a compressed cache.

    python -m kvcli.integrations.lm_eval --model kvcli --model_args method=treekv,cache=1024 \
        --tasks TASK --include_path DIR

lm-eval (``pip install 'kvcli[eval]'``, 0.4.10 to 0.4.x) finds a model by name in its registry, and no
release reads plugin entry points: a model of another package is there only once that package is imported.
This module registers :class:`KvcliLM` when it is imported, and nothing else in kvcli imports it (the library
and the CLI run without lm-eval installed). So the two routes are ``python -m kvcli.integrations.lm_eval ARGS``
(:func:`main`: lm-eval's own command line after this import) and, from Python, ``import kvcli.integrations.lm_eval``
before ``lm_eval.simple_evaluate(model="kvcli", ...)``. Plain ``lm_eval --model kvcli`` does not find it.

What each request type does under compression (docs/lm-eval.md):

* ``loglikelihood(context, continuation)``: the context is read into a fresh cache as ``kvcli ask``
  reads a document (:meth:`kvcli.reading.reader.Reader.read`: one forward pass when it fits the model's
  context, else streamed in blocks, compressed to the budget either way); the continuation is then
  run against that cache and scored token by token, greedy if every token is the argmax.
* ``loglikelihood_rolling(text)``: the text is one stream scored by :meth:`kvcli.engine.engine.Engine.score`,
  the function behind ``kvcli ppl``, with one token in front so that the first token is scored too.
* ``generate_until(context, gen_kwargs)``: the context is read as above, then :meth:`Reader.write`
  generates against the cache, every new token compressed like the rest.

Requests run one at a time (kvcli streams one sequence per cache); ``batch_size`` is accepted and ignored.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import lm_eval.models  # noqa: F401 - lm-eval fills its registry with the built-in models only when it is empty
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvcli.engine.engine import Engine
from kvcli.errors import KvcliError, UsageError
from kvcli.integrations.lm_eval.args import ModelArgs
from kvcli.io.report import warn
from kvcli.io.text import leading_special_tokens
from kvcli.models.load import DEFAULT_MODEL
from kvcli.reading.generate import Generation
from kvcli.reading.prompts import PromptParts, stop_token_ids
from kvcli.reading.reader import Reader, one_shot_limit

#: Keys of ``gen_kwargs`` that generation honours; lm-eval tasks may pass others (top_p), which are ignored.
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature")


@dataclass(frozen=True)
class GenerationArgs:
    """What a ``generate_until`` request's ``gen_kwargs`` ask: stop strings, how many new tokens at most, and the
    sampling temperature (0: greedy, unless ``do_sample``)."""

    until: list[str]
    max_new: int
    temperature: float

    @classmethod
    def read(cls, gen_kwargs: dict, max_gen_toks: int, warned: set[str]) -> GenerationArgs:
        """``gen_kwargs`` as lm-eval passes them; ``max_gen_toks`` (the model's) when the request sets none. A key
        generation does not honour is said once per model (``warned``: the keys already said)."""
        ignored = sorted(set(gen_kwargs) - set(GEN_KWARGS) - warned)
        if ignored:
            warned.update(ignored)
            warn(f"kvcli ignores gen_kwargs {', '.join(ignored)} (it honours {', '.join(GEN_KWARGS)})")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.get("max_gen_toks", max_gen_toks))
        temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
        return cls(until, max_new, temperature)


@register_model("kvcli")
class KvcliLM(TemplateLM):
    """lm-eval's view of a kvcli engine: a model, a compression method and a budget, from ``--model_args``.

    ``model_args`` keys: ``model`` (or lm-eval's ``pretrained``; any model ``kvcli ppl --model`` takes),
    ``method``, ``cache`` (tokens per layer), ``block``, ``kv_bits`` (16, 8, 4 or 2), ``device``, ``dtype``,
    ``one_shot`` (how a context is read: auto, true, false), ``max_gen_toks``, ``seed``; every other
    key is a parameter of the method (``sinks=8``), as ``kvcli ppl -o sinks=8``.
    """

    def __init__(self, model: str = DEFAULT_MODEL, method: str = "streamingllm", cache: int = 1024,
                 block: int | str = "auto", kv_bits: int = 16, device: str = "auto", dtype: str = "auto",
                 one_shot: bool | str | None = None, max_gen_toks: int = 256, seed: int = 0,
                 pretrained: str | None = None, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, **options) -> None:
        super().__init__()
        args = ModelArgs(model=str(pretrained or model), method=method, cache=cache, block=block, kv_bits=kv_bits,
                         device=device, dtype=dtype, one_shot=one_shot, max_gen_toks=max_gen_toks, seed=seed,
                         options=options).validate()  # before the model loads (seconds to minutes)
        self.one_shot, self.max_gen_toks, self.seed = args.one_shot, args.max_gen_toks, args.seed
        self.loaded, self.engine = args.load()
        self.tokenizer = self.loaded.tokenizer
        self._device = self.loaded.device
        #: What kvcli puts before every document (a BOS, or nothing): read before every context too.
        self.lead = leading_special_tokens(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer, self.loaded.model)
        self._warned_kwargs: set[str] = set()

    # --- what TemplateLM asks of a model ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions a text's first token: the tokenizer's own BOS when it adds one (what
        ``kvcli ppl`` streams first, so rolling scores equal kvcli's), else lm-eval's convention for
        Hugging Face models: the BOS token if the vocabulary has one, otherwise EOS."""
        if self.lead:
            return self.lead[0]
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer in lm-eval's request cache and its record of a chat-templated run."""
        return self.loaded.name.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's ``--apply_chat_template``: the conversation as the tokenizer's chat template writes it
        (:func:`chat_text`), keeping the template's special tokens (``<|im_start|>``), which :meth:`tok_encode`
        parses."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"{self.loaded.name} has no chat template: run without --apply_chat_template")
        return chat_text(self.tokenizer, chat_history, add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of a piece of text; special tokens only when asked (contexts get them when read)."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens), verbose=False).input_ids)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # --- loglikelihood ----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in tqdm(requests, desc="kvcli loglikelihood", disable=disable_tqdm):
            answer = self.score_continuation(context, continuation)
            self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def _read(self, context: list[int], after: int) -> tuple[object, torch.Tensor]:
        """A fresh cache holding ``context`` as kvcli reads a document, and the last context token's hidden
        state. ``after`` tokens follow (continuation or generation): a one-shot read leaves room for them."""
        parts = PromptParts(prefix=[] if context[:len(self.lead)] == self.lead else list(self.lead), suffix=[],
                            chat=False)
        reader = Reader(self.engine, self.tokenizer)
        cache = self.engine.new_cache()
        hidden = reader.read(cache, parts, [context], Generation(), one_shot=self.one_shot,
                             limit=one_shot_limit(self.engine, after))
        return cache, hidden

    def score_continuation(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability (nats) of ``continuation`` after ``context`` read into a compressed cache, and
        whether greedy decoding would have written it (:func:`continuation_logprob`)."""
        if not context:
            raise KvcliError("a loglikelihood request needs a context (lm-eval gives the prefix token)")
        if not continuation:
            return 0.0, True
        cache, hidden = self._read(context, len(continuation))
        return continuation_logprob(self.engine, cache, hidden, continuation)

    # --- loglikelihood_rolling --------------------------------------------------------------------
    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in tqdm([req.args for req in requests], desc="kvcli rolling", disable=disable_tqdm):
            logprob = self.score_text(text)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), logprob)
            out.append(logprob)
        return out

    def score_text(self, text: str) -> float:
        """Log-probability (nats) of every token of ``text``: one stream through the compressed cache, scored
        by the engine exactly as ``kvcli ppl`` scores a document. kvcli ppl leaves a document's first token
        unscored (nothing predicts it); lm-eval wants it, so a tokenizer without a BOS gets
        :attr:`prefix_token_id` in front, read and not scored. With a BOS the stream is kvcli ppl's own."""
        ids = self.tok_encode(text)
        if not ids:
            return 0.0
        stream = (self.lead or [self.prefix_token_id]) + ids
        totals = self.engine.score([stream])
        if totals.interrupted:  # the engine stops quietly on Ctrl-C; a partial score must not reach lm-eval
            raise KeyboardInterrupt
        return -totals.nll_sum

    # --- generate_until ---------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([req.args for req in requests], desc="kvcli generate",
                                        disable=disable_tqdm):
            text = self.generate(context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def generate(self, context: str, gen_kwargs: dict) -> str:
        """Text written after ``context`` read into a compressed cache, cut before the first ``until`` string."""
        asked = GenerationArgs.read(gen_kwargs, self.max_gen_toks, self._warned_kwargs)
        reader = Reader(self.engine, self.tokenizer, stop_ids=self.stop_ids, stop=asked.until,
                        temperature=asked.temperature, seed=self.seed)
        ids = self.tok_encode(context)
        if not ids:
            ids = [self.prefix_token_id]
        cache, hidden = self._read(ids, asked.max_new)
        result = Generation()
        reader.write(cache, hidden, result, asked.max_new)
        if result.finish_reason == "interrupted":  # the reader stops quietly on Ctrl-C; lm-eval must stop too
            raise KeyboardInterrupt
        return result.text


def chat_text(tokenizer, chat_history: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The conversation as the tokenizer's chat template writes it, as lm-eval's Hugging Face model does: without
    ``add_generation_prompt`` the last (assistant) message is continued rather than closed, and a template that
    refuses a system turn gets the conversation without it."""
    from jinja2.exceptions import TemplateError

    def render(history: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)

    try:
        return render(chat_history)
    except TemplateError:
        return render([message for message in chat_history if message["role"] != "system"])


def continuation_logprob(engine: Engine, cache, hidden: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """Log-probability (nats) of ``continuation`` against a ``cache`` that holds its context (``hidden``: the last
    context token's hidden state), and whether greedy decoding would have written it. The continuation runs in
    blocks: its own tokens see each other exactly, and the cache only as the method left it."""
    predictors = [hidden]
    last = len(continuation) - 1  # the last token predicts nothing that is scored: it is never run
    for start in range(0, last, engine.block):
        ids = torch.tensor([continuation[start:min(start + engine.block, last)]], dtype=torch.long)
        predictors.append(engine.forward(cache, ids))
    greedy = [True]

    def check(logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        greedy[0] = greedy[0] and bool((logprobs.argmax(dim=-1) == targets).all())

    targets = torch.tensor(continuation, dtype=torch.long)
    nll = engine.token_nll(torch.cat(predictors), targets, on_logits=check)
    return -float(nll.sum()), greedy[0]


def main() -> None:
    """``python -m kvcli.integrations.lm_eval ARGS``: lm-eval's own command line, with the model ``kvcli`` registered.

    A mistake in ``--model_args`` is one line on stderr (exit 2; 1 for a runtime problem such as a model
    that is not installed), as everywhere in kvcli.
    """
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except UsageError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KvcliError as exc:
        print(f"kvcli: error: {exc}", file=sys.stderr)
        sys.exit(1)

