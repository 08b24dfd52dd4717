"""The block-streaming engine: one forward pass per block against a cache compressed after every block.

The engine knows nothing about files or the CLI. It takes token ids, runs them through the model in
blocks of ``block`` tokens, scores every token exactly once (the NLL of token t comes from the
logits at t-1, carried across block boundaries), and after every block lets the method shrink each
layer back to its budget. Positions are re-assigned inside the cache (see :mod:`kvcli.kv.cache`), so
the stream can be far longer than the model's trained context while memory stays flat.

The parts live in their own modules: the block loop, its totals and the NLL of a block's tokens in
:mod:`kvcli.engine.streaming` (:class:`~kvcli.engine.streaming.BlockScorer`, the engine's scoring side), the
compression step (every budgeted layer after a forward, and the nested forward) in
:mod:`kvcli.engine.compression`, what a forward observes for the method in :mod:`kvcli.engine.observation`,
the cache a run starts from in :mod:`kvcli.engine.cache_factory`, the positions a block gets in
:mod:`kvcli.kv.positions`. Their public names are importable from here too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from kvcli.engine.cache_factory import heads_apart, key_mode, new_cache
from kvcli.engine.compression import compress_cache, layer_budgets, nested_forward
from kvcli.engine.observation import plan_observation, voters
from kvcli.engine.streaming import (
    BlockScorer,
    BlockStats,
    LogitsHook,
    StreamState,
    StreamTotals,
    blocks_of,
    to_device,
)
from kvcli.errors import UsageError
from kvcli.kv.architecture import describe, head_shape
from kvcli.kv.cache import KVCache
from kvcli.kv.positions import BlockPositions
from kvcli.kv.rows import CacheRows
from kvcli.kv.scores import settle
from kvcli.methods.base import Method

__all__ = ["DEFAULT_BLOCK", "BlockStats", "Engine", "LogitsHook", "StreamState", "StreamTotals", "blocks_of",
           "budget_for_bytes", "check_budget", "default_block", "kv_bytes_per_token"]


def check_budget(method: Method, budget: int | None) -> int | None:
    """The one validation of a budget (tokens per layer, on average): the budget the engine will use.

    An unbounded method (``full``) ignores it and gets None; every other method needs a positive
    budget that holds what it always keeps. Errors name the budget, not a flag: the CLI, which
    knows the flag, words them for the user (see :class:`kvcli.errors.BudgetError`).
    """
    from kvcli.methods.registry import check_params

    check_params(method)  # parameters in their ranges first: a method made in Python skipped make_method's check
    if method.unbounded:
        return None
    if budget is None or budget < 1:
        raise UsageError(f"{method.name} needs a budget of at least 1 token, not {budget}")
    method.validate(budget)
    return budget


#: Tokens per forward pass when the user does not choose: a CPU is near its matmul rate at 256
#: tokens, while a GPU needs larger blocks to fill its cores (both measured in docs/benchmarks.md).
DEFAULT_BLOCK = {"cpu": 256, "cuda": 1024}


def default_block(device: torch.device | str) -> int:
    """The block size kvcli uses on ``device`` unless told otherwise (``--block auto``)."""
    return DEFAULT_BLOCK.get(torch.device(device).type, DEFAULT_BLOCK["cpu"])


def check_block(block: int | None, device: torch.device | str) -> int:
    """The block an engine on ``device`` runs: ``block`` (at least 1 token), or :func:`default_block` for None."""
    if block is None:
        return default_block(device)
    if block < 1:
        raise UsageError(f"a block must hold at least 1 token, not {block}")
    return block


def budget_for_bytes(method: Method, model: torch.nn.Module, nbytes: int, dtype: torch.dtype,
                     kv_bits: int = 16, kv_keys: str | None = None) -> int:
    """The budget (tokens per layer) that gives ``method`` a cache of at most ``nbytes`` bytes on ``model``.

    A plain cache of B tokens per layer costs B times :func:`kv_bytes_per_token`; a method that stores
    fewer keys per token turns those bytes into more tokens (:meth:`Method.equal_bytes_budget`).
    At ``kv_bits`` below 16 a token costs its packed bytes, scales and zero points, and the full-precision
    residual is paid for (:func:`kvcli.kv.quant.tokens_for_bytes`), keys rounded the ``kv_keys`` way. Every token
    also pays its bookkeeping (positions and the method's per-token state, :func:`kvcli.kv.quant.bookkeeping_bytes`).
    A layer with an attention window (Gemma 3's sliding layers) holds its window whatever the budget: its bytes are
    paid first, and the budget is what the other layers may keep in the rest.
    """
    from kvcli.kv.quant import cache_bytes, token_costs, tokens_for_bytes

    per_token = kv_bytes_per_token(model, dtype)
    states = method.token_states
    architecture = describe(model)
    keys = key_mode(method, kv_bits, kv_keys, architecture.key_norm)
    windows = architecture.windows
    fixed = cache_bytes(model.config, 0, kv_bits, dtype, keys, states, windows)  # the window layers' own tokens
    if all(window is not None for window in windows):
        raise UsageError("--cache-bytes governs no layer of this model: every layer keeps its attention window "
                         f"({fixed:,} bytes); leave the budget out")
    plain = tokens_for_bytes(model.config, nbytes, kv_bits, dtype, keys, states, windows)
    if plain < 1:
        held = f" beside the {fixed:,} bytes its attention-window layers hold" if fixed else ""
        raise UsageError(f"{nbytes:,} bytes cannot hold one token per layer ({per_token:,} bytes per token){held}")
    return method.equal_bytes_budget(plain, model.config, token_costs(model.config, kv_bits, dtype, keys, states))


class Engine(BlockScorer):
    """Runs a model over token blocks with a compressed cache.

    ``budget`` is the per-layer budget in tokens on average (methods such as PyramidKV spread it
    unevenly); it is ignored by an unbounded method (``full``).
    """

    def __init__(self, model: torch.nn.Module, method: Method, budget: int | None, block: int | None = None,
                 warn: Callable[[str], None] | None = None, kv_bits: int = 16, kv_keys: str | None = None):
        from kvcli.kv.quant import check_kv_bits, check_kv_keys

        self.device = next(model.parameters()).device
        self.model = model
        self.method = method
        self.block = check_block(block, self.device)
        self.kv_bits = check_kv_bits(kv_bits, "kv_bits")  # bits per cached key and value element (kvcli.kv.quant)
        self.kv_keys = check_kv_keys(kv_keys, "kv_keys")  # how keys are rounded (None: by bits and model)
        self.budget = check_budget(method, budget)
        self.architecture = describe(model)  # refuses a model whose positions cannot be re-assigned
        self.num_layers = model.config.num_hidden_layers
        self.trained_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.budgets = layer_budgets(method, self.architecture, self.budget, self.num_layers)
        self.warn = warn or (lambda message: warnings.warn(message, stacklevel=2))
        if self.kv_bits == 2 and self.cache_key_mode == "token":  # PoD's keys, or --kv-keys token
            self.warn("keys rounded per token at 2 bits lose much of what the cache holds (docs/results.md, "
                      "'Every method at every bit width on Emma'); --kv-bits 4 costs little")
        self.positions = BlockPositions(self.architecture.rope_limit, self.trained_context, self.warn)
        self.decoder = model.get_decoder()
        #: Read each block's NLL to the host one block late (see :meth:`score`): on a GPU only, where
        #: reading at once would stall the device once per block.
        self.lag_host_reads = self.device.type == "cuda"
        self.head = model.get_output_embeddings()

    @property
    def cache_key_mode(self) -> str | None:
        """How the cache rounds keys (``token``, ``channel`` or ``pca``); None at 16 bits."""
        return key_mode(self.method, self.kv_bits, self.kv_keys, self.architecture.key_norm)

    def new_cache(self) -> KVCache:
        """A fresh cache for a run (:mod:`kvcli.engine.cache_factory`), its positions laid out by this engine's
        budgets, block and trained context."""
        apart = heads_apart(self.method, self.model.config, self.budgets, self.block, self.trained_context)
        return new_cache(self.method, self.model, self.kv_bits, self.kv_keys, apart, self.architecture.key_norm)

    @torch.inference_mode()
    def forward(self, cache: KVCache, ids: torch.Tensor, probe: torch.Tensor | None = None,
                compress: bool = True, decoding: bool = False, last_only: bool = False,
                question: int = 0, observe: Callable[[KVCache], None] | None = None, held: int = 0,
                span: tuple[int, int] | None = None) -> torch.Tensor:
        """Run ``ids`` ``[1, n]`` against ``cache``, compress, and return the last hidden states ``[n, d]``.

        Hidden states rather than logits: a 49k-token vocabulary makes the logits of a block the
        largest tensor of the pass, so :meth:`token_nll` projects them in small chunks instead.

        ``probe`` holds query tokens (a question) that score the cache without entering it:
        query-aware compression. ``question`` says the block's own last ``question`` tokens are the
        question, ``span`` which of the question's (or the probe's) tokens vote, ``held`` that its last
        ``held`` tokens stay whatever they score: what the method observes follows from them
        (:mod:`kvcli.engine.observation`). ``decoding`` marks a generated token (see
        :class:`kvcli.kv.cache.LayerView`).

        ``last_only`` says the caller needs the hidden state of the block's last token only (a read, never
        ``ppl``): a method that nests its selection (:meth:`nests_here`, PyramidInfer) then runs a nested forward
        (:func:`kvcli.engine.compression.nested_forward`), and the returned hidden states are those of the tokens
        the top layer processed, in stream order, the last row still the block's last token.

        ``observe(cache)`` runs after a probe has scored the block and before the compression, while every
        layer's attention record is alive (the recap of a streamed ``ask``, :mod:`kvcli.reading.recap`).
        """
        n = ids.shape[1]
        compressing = compress and self.compresses() and not (decoding and self.method.keeps_answer)
        observation = plan_observation(self.method, n, compressing, probe is not None, question, held, span)
        cache.question_scores = observation.asks
        cache.score_window, cache.score_skip = observation.window, observation.skip
        nested = compressing and last_only and probe is None and not decoding and self.nests_here()
        done: set[int] = set()
        try:
            if nested:  # each layer compressed before the next runs, which processes only the tokens it passes on
                hidden = nested_forward(lambda: self._run(cache, ids, store=True), self.method, cache,
                                        self.decoder.layers, self.budgets, self.budget, n, self.device, done,
                                        observation.question, observation.held)
            else:
                hidden = self._run(cache, ids, store=True)
            cache.stream_start += n  # before the probe, whose queries come after the block
            if probe is not None and observation.asks:
                cache.score_window, cache.score_skip = voters(span, probe.shape[1])
                self._run(cache, probe, store=False)
                if observe is not None:
                    observe(cache)
            if compressing:  # every layer the budget governs, but those a nested forward compressed already
                compress_cache(self.method, cache, self.architecture.budgeted, self.budgets, self.budget, n, decoding,
                               done, observation.question, observation.held)
        finally:
            forget_scores(cache)
        return hidden[0]

    @torch.inference_mode()
    def probe(self, cache: KVCache, ids: torch.Tensor) -> None:
        """Run ``ids`` ``[1, n]`` after ``cache`` without storing them, recording or compressing anything: a pass
        whose activations a caller reads through hooks (the queries of a question, :mod:`kvcli.reading.recall`)."""
        cache.score_window, cache.score_skip = 0, 0
        try:
            self._run(cache, ids, store=False)
        finally:
            forget_scores(cache)

    def compresses(self) -> bool:
        """Whether a forward compresses at all: the method has a budget and some layer is governed by it."""
        return bool(self.budgets) and bool(self.architecture.budgeted)

    def evicts_while_writing(self) -> bool:
        """Whether a generated token's forward may evict (else the answer only ever adds to the cache)."""
        return self.compresses() and not self.method.keeps_answer

    def nests_here(self) -> bool:
        """Whether a read may run nested on this model: the method nests and every layer is budgeted.

        A layer with an attention window (Gemma 2/3, GPT-OSS, Mistral, Qwen 2's sliding layers) needs
        the W - 1 consecutive tokens before each query, so a model with one reads un-nested.
        """
        return self.method.nests() and len(self.architecture.budgeted) == self.num_layers

    def _run(self, cache: KVCache, ids: torch.Tensor, store: bool) -> torch.Tensor:
        """The decoder over ``ids`` at their positions in ``cache``, storing them (``store``) or only probing."""
        return self.run_rows([cache], ids, store)

    def run_rows(self, caches: Sequence[KVCache], ids: torch.Tensor, store: bool) -> torch.Tensor:
        """The decoder over row ``b`` of ``ids`` at its positions in ``caches[b]`` (one cache: the model reads it
        as it is; several: as one :class:`~kvcli.kv.rows.CacheRows`, see :func:`kvcli.engine.batched.forward_rows`)."""
        positions = torch.cat([self.positions.place(cache, ids.shape[1], self.device) for cache in caches])
        for cache in caches:
            cache.probing = not store
            cache.plan_rotation()
        past = caches[0] if len(caches) == 1 else CacheRows(caches)
        try:
            out = self.decoder(input_ids=to_device(ids, self.device), position_ids=positions, past_key_values=past,
                               use_cache=True, kvcli_cache=past)
            for cache in caches:
                settle(cache)  # every layer's window scores, recorded before anything reads them
        finally:
            for cache in caches:
                cache.probing = False
                cache.clear_rotation()
        return out.last_hidden_state


def forget_scores(cache: KVCache) -> None:
    """After a forward: nothing it recorded for the method (scores, window logits, attention records) outlives it."""
    cache.question_scores = False
    cache.score_skip = 0
    cache.waiting.clear()
    for layer in cache.layers:
        layer.record = None


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes one token costs in an uncompressed cache: keys and values of every layer and KV head."""
    config = model.config
    kv_heads, head_dim = head_shape(config)
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element
