"""The block-streaming engine: one forward pass per block against a cache compressed after every block.

The engine knows nothing about files or the CLI. It takes token ids, runs them through the model in
blocks of ``block`` tokens, scores every token exactly once (the NLL of token t comes from the
logits at t-1, carried across block boundaries), and after every block lets the method shrink each
layer back to its budget. Positions are re-assigned inside the cache (see :mod:`kvcli.kv.cache`), so
the stream can be far longer than the model's trained context while memory stays flat.

The parts live in their own modules: the block loop and its totals in :mod:`kvcli.engine.streaming`, the
compression step (every budgeted layer after a forward, and the nested forward) in
:mod:`kvcli.engine.compression`, the positions a block gets in :mod:`kvcli.kv.positions`. Their public names
are importable from here too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch

from kvcli.engine.compression import compress_cache, layer_budgets, nested_forward
from kvcli.engine.streaming import (
    BlockStats,
    LogitsHook,
    StreamState,
    StreamTotals,
    blocks_of,
    score_sliding,
    score_stream,
)
from kvcli.errors import UsageError
from kvcli.kv.architecture import describe
from kvcli.kv.cache import KVCache
from kvcli.kv.positions import BlockPositions
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


#: Rows of logits a CPU projects at a time in :meth:`Engine.token_nll`: small enough for its caches.
NLL_ROWS_CPU = 64

#: On a GPU the rows of one projection are bounded by their fp32 logits instead (2^26 values, 256 MiB): a
#: few large matmuls keep the card busy, where 64-row ones each cost a launch and run far below its rate.
NLL_VALUES_GPU = 1 << 26


def nll_chunk(device: torch.device | str, vocab: int) -> int:
    """Rows of hidden states :meth:`Engine.token_nll` projects to logits at once on ``device``."""
    if torch.device(device).type == "cpu":
        return NLL_ROWS_CPU
    return max(NLL_ROWS_CPU, NLL_VALUES_GPU // vocab)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. A CPU tensor bound for a GPU is copied from pinned memory without blocking:
    a copy from ordinary (pageable) memory makes the host wait for every kernel already queued, a
    host-device sync at every block that leaves the GPU idle while the next block is launched."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def default_block(device: torch.device | str) -> int:
    """The block size kvcli uses on ``device`` unless told otherwise (``--block auto``)."""
    return DEFAULT_BLOCK.get(torch.device(device).type, DEFAULT_BLOCK["cpu"])


def key_mode(method: Method, kv_bits: int, kv_keys: str | None) -> str | None:
    """How ``method``'s cache rounds keys at ``kv_bits`` when asked for ``kv_keys``: None at 16 bits; always
    per token for PoD, which reads its keys rotated from their entry positions (:meth:`PodCache.quantize`)."""
    from kvcli.kv.quant import KVQuant

    if kv_bits == 16:
        return None
    return "token" if method.name == "pod" else KVQuant(kv_bits, keys=kv_keys).key_mode


def budget_for_bytes(method: Method, model: torch.nn.Module, nbytes: int, dtype: torch.dtype,
                     kv_bits: int = 16, kv_keys: str | None = None) -> int:
    """The budget (tokens per layer) that gives ``method`` a cache of at most ``nbytes`` bytes on ``model``.

    A plain cache of B tokens per layer costs B times :func:`kv_bytes_per_token`; a method that stores
    fewer keys per token turns those bytes into more tokens (:meth:`Method.equal_bytes_budget`).
    At ``kv_bits`` below 16 a token costs its packed bytes, scales and zero points, and the full-precision
    residual is paid for (:func:`kvcli.kv.quant.tokens_for_bytes`), keys rounded the ``kv_keys`` way.
    """
    from kvcli.kv.quant import tokens_for_bytes

    per_token = kv_bytes_per_token(model, dtype)
    plain = tokens_for_bytes(model.config, nbytes, kv_bits, dtype, key_mode(method, kv_bits, kv_keys))
    if plain < 1:
        raise UsageError(f"{nbytes:,} bytes cannot hold one token per layer ({per_token:,} bytes per token)")
    return method.equal_bytes_budget(plain, model.config)


class Engine:
    """Runs a model over token blocks with a compressed cache.

    ``budget`` is the per-layer budget in tokens on average (methods such as PyramidKV spread it
    unevenly); it is ignored by an unbounded method (``full``).
    """

    def __init__(self, model: torch.nn.Module, method: Method, budget: int | None, block: int | None = None,
                 warn: Callable[[str], None] | None = None, kv_bits: int = 16, kv_keys: str | None = None):
        from kvcli.kv.quant import check_kv_bits, check_kv_keys

        self.device = next(model.parameters()).device
        if block is None:
            block = default_block(self.device)
        if block < 1:
            raise UsageError(f"a block must hold at least 1 token, not {block}")
        self.model = model
        self.method = method
        self.block = block
        self.kv_bits = check_kv_bits(kv_bits, "kv_bits")  # bits per cached key and value element (kvcli.kv.quant)
        self.kv_keys = check_kv_keys(kv_keys, "kv_keys")  # keys rounded per token or channel (None: by bits)
        self.budget = check_budget(method, budget)
        self.architecture = describe(model)  # refuses a model whose positions cannot be re-assigned
        self.num_layers = model.config.num_hidden_layers
        self.trained_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.budgets = self._layer_budgets()
        self.warn = warn or (lambda message: warnings.warn(message, stacklevel=2))
        self.positions = BlockPositions(self.architecture.rope_limit, self.trained_context, self.warn)
        self.decoder = model.get_decoder()
        #: Read each block's NLL to the host one block late (see :meth:`score`): on a GPU only, where
        #: reading at once would stall the device once per block.
        self.lag_host_reads = self.device.type == "cuda"
        self.head = model.get_output_embeddings()

    def _layer_budgets(self) -> list[int | None] | None:
        return layer_budgets(self.method, self.architecture, self.budget, self.num_layers)

    @property
    def cache_key_mode(self) -> str | None:
        """How the cache rounds keys (``token`` or ``channel``); None at 16 bits."""
        return key_mode(self.method, self.kv_bits, self.kv_keys)

    def new_cache(self) -> KVCache:
        cache = self.method.new_cache(self.model).quantize(self.kv_bits, self.kv_keys)
        cache.heads_apart = self.heads_apart
        return cache

    @property
    def heads_apart(self) -> bool:
        """Whether streamed positions follow the tokens all KV heads of a layer hold (:attr:`KVCache.heads_apart`):
        when the method's heads keep different tokens and the span that gives, at most every head's budget
        side by side plus two blocks, stays within the trained context (else each head's tokens are compacted)."""
        if not (self.budgets and self.method.selects_per_head()):
            return False
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        span = heads * max(budget or 0 for budget in self.budgets) + 2 * self.block
        return not self.trained_context or span <= self.trained_context

    @torch.inference_mode()
    def forward(self, cache: KVCache, ids: torch.Tensor, probe: torch.Tensor | None = None,
                compress: bool = True, decoding: bool = False, last_only: bool = False,
                question: int = 0, observe: Callable[[KVCache], None] | None = None, held: int = 0) -> torch.Tensor:
        """Run ``ids`` ``[1, n]`` against ``cache``, compress, and return the last hidden states ``[n, d]``.

        Hidden states rather than logits: a 49k-token vocabulary makes the logits of a block the
        largest tensor of the pass, so :meth:`token_nll` projects them in small chunks instead.

        ``probe`` holds query tokens (a question) that score the cache without entering it:
        query-aware compression. ``question`` says the block's own last ``question`` tokens are the
        question (the end of a prompt read in one shot, or the last block of a streamed read).
        Whenever a question is known, its queries alone are the observation window, all of them,
        whatever the method's own window: the text's last queries do not vote (FINCH's rule for
        streamed chunks; in a one-shot read SnapKV's window sized to the question). A method that
        scores nothing (StreamingLLM) runs no probe. ``decoding`` marks a generated token (see
        :class:`kvcli.kv.cache.LayerView`). ``held`` (at least ``question``) says the block's last ``held`` tokens
        stay in every layer whatever they score, as the question does (:attr:`kvcli.kv.cache.LayerView.held`).

        ``last_only`` says the caller needs the hidden state of the block's last token only (a read
        for ``summarize``/``ask``/``needle``, never ``ppl``). A method that nests its selection
        (:meth:`Method.nests`, PyramidInfer) then compresses each layer as soon as it has run, and the
        next layer processes only the tokens the method passes on (:meth:`Method.compress_nested`,
        :meth:`nests_here`): the returned hidden states are those of the tokens the top layer processed,
        in stream order, the last row still the block's last token.

        ``observe(cache)`` runs after a probe has scored the block and before the compression, while every
        layer's attention record is alive (the recap of a streamed ``ask``, :mod:`kvcli.reading.recap`).
        """
        n = ids.shape[1]
        compressing = compress and self.compresses() and not (decoding and self.method.keeps_answer)
        scores = self.method.score_window(n) if compressing else 0
        question = min(question, n) if scores and probe is None else 0  # with a probe, the probe is the question
        held = max(min(held, n), question) if question else 0
        asks = scores > 0 and (probe is not None or question > 0)
        cache.question_scores = asks
        cache.score_window = question if asks else scores
        nested = compressing and last_only and probe is None and not decoding and self.nests_here()
        done: set[int] = set()
        try:
            if nested:
                hidden = self._run_nested(cache, ids, done, question, held)
            else:
                hidden = self._run(cache, ids, store=True)
            cache.stream_start += n  # before the probe, whose queries come after the block
            if probe is not None and asks:
                cache.score_window = probe.shape[1]
                self._run(cache, probe, store=False)
                if observe is not None:
                    observe(cache)
            if compressing:
                self.compress(cache, n, decoding, skip=done, question=question, held=held)
        finally:
            cache.question_scores = False
            cache.waiting.clear()
            for layer in cache.layers:
                layer.record = None
        return hidden[0]

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

    def _run_nested(self, cache: KVCache, ids: torch.Tensor, done: set[int], question: int = 0,
                    held: int = 0) -> torch.Tensor:
        """One forward in which each layer is compressed before the next runs, which processes only the
        tokens it passes on (:func:`kvcli.engine.compression.nested_forward`); ``done`` gets the layers compressed."""
        return nested_forward(lambda: self._run(cache, ids, store=True), self.method, cache, self.decoder.layers,
                              self.budgets, self.budget, ids.shape[1], self.device, done, question, held)

    def _run(self, cache: KVCache, ids: torch.Tensor, store: bool) -> torch.Tensor:
        positions = self.positions.place(cache, ids.shape[1], self.device)
        cache.probing = not store
        cache.plan_rotation()
        try:
            out = self.decoder(input_ids=to_device(ids, self.device), position_ids=positions, past_key_values=cache,
                               use_cache=True, kvcli_cache=cache)
            settle(cache)  # every layer's window scores, recorded before anything reads them
        finally:
            cache.probing = False
            cache.clear_rotation()
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @torch.inference_mode()
    def token_nll(self, hidden: torch.Tensor, targets: torch.Tensor, chunk: int | None = None,
                  on_logits: LogitsHook | None = None) -> torch.Tensor:
        """NLL (nats, float32) of ``targets[i]`` given ``hidden[i]``, projecting a few rows at a time.

        Chunks keep the logits small enough for the CPU's caches and never build the block's full
        log-softmax output, which ``cross_entropy`` over the whole block would; ``chunk`` None is
        :func:`nll_chunk`'s rows for the device. ``on_logits`` sees
        each chunk's log-probabilities ``[rows, V]`` (float32) and targets, in stream order
        (``kvcli ppl --save-logits/--kl-base``).
        """
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        targets = to_device(targets, hidden.device)
        chunk = chunk or nll_chunk(hidden.device, self.head.out_features)
        for i in range(0, targets.shape[0], chunk):
            logits = self.head(hidden[i:i + chunk]).float()
            picked = logits.gather(1, targets[i:i + chunk, None])[:, 0]
            total = torch.logsumexp(logits, dim=-1)
            out[i:i + chunk] = total - picked
            if on_logits is not None:
                on_logits(logits - total[:, None], targets[i:i + chunk])
        return out

    def compress(self, cache: KVCache, num_new: int, decoding: bool = False, skip: set[int] = frozenset(),
                 question: int = 0, held: int = 0) -> None:
        """Let the method shrink every layer the budget governs (:func:`kvcli.engine.compression.compress_cache`)."""
        compress_cache(self.method, cache, self.architecture.budgeted, self.budgets, self.budget, num_new, decoding,
                       skip, question, held)

    def score(self, token_chunks: Iterable[list[int] | torch.Tensor], *, max_tokens: int | None = None,
              cache: KVCache | None = None, score_from: int = 0,
              on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
              state: StreamState | None = None,
              on_state: Callable[[StreamState], None] | None = None,
              on_logits: LogitsHook | None = None) -> StreamTotals:
        """Stream tokens through the model and sum the NLL of every token after the first (the block
        loop is :func:`kvcli.engine.streaming.score_stream`).

        ``score_from`` skips scoring the first tokens (they are still read into the cache), for the
        sliding-window protocol. Ctrl-C ends the stream early with what was measured so far: the totals
        of the blocks scored whole, nothing of the block it cut.
        ``state`` continues a stream from a checkpoint (``token_chunks`` then hold the tokens after
        ``state.position``); ``on_state`` sees the state after every block, for checkpoints.
        ``on_logits`` sees the scored tokens' log-probabilities (KL against a reference). Each block's
        NLL reaches the host once; on a GPU one block late (:attr:`lag_host_reads`).
        """
        return score_stream(self, token_chunks, max_tokens=max_tokens, cache=cache, score_from=score_from,
                            on_block=on_block, state=state, on_state=on_state, on_logits=on_logits)

    def score_sliding(self, token_chunks: Iterable[list[int] | torch.Tensor], context: int, stride: int, *,
                      lead: Sequence[int] = (), on_block: Callable[[BlockStats, StreamTotals], None] | None = None,
                      on_logits: LogitsHook | None = None) -> StreamTotals:
        """The papers' sliding-window protocol: windows of ``context`` tokens every ``stride``, each from an
        empty cache, ``lead`` read in front of every window after the first
        (:func:`kvcli.engine.streaming.score_sliding`)."""
        return score_sliding(self, token_chunks, context, stride, lead=lead, on_block=on_block, on_logits=on_logits)


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes one token costs in an uncompressed cache: keys and values of every layer and KV head."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element
