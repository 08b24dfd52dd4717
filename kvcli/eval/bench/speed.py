"""Speed on named model shapes: tokens/s, model FLOPs utilisation and peak memory, kvcli next to a plain forward.

``kvcli bench-speed`` (see :mod:`kvcli.cli.speed`) calls :func:`run_speed`. A shape from :data:`SHAPES` is
built with random weights directly on the target device in the target dtype: no download, no tokenizer
(the token ids are random integers from a seeded generator). Speed does not depend on the weights, so
the numbers hold for the real checkpoints of the same shape; perplexity is meaningless here and is not
reported.

For each requested method the engine streams ``tokens`` tokens in blocks against a cache compressed back
to ``cache`` tokens per layer; the plain line runs stock transformers forwards (SDPA attention, a
``DynamicCache`` cropped back to ``cache`` tokens after every block) of the same blocks. Both start from
a full cache after an untimed warm-up, so every timed block attends to the same number of keys.

Model FLOPs utilisation (MFU) is the model's useful FLOPs per second over the **measured** rate of one
large square matmul in the same dtype on the same device (:func:`matmul_rate`), not the datasheet's peak:
a card's datasheet number is rarely reached, and a CPU has none. Useful FLOPs per token are
``2 x`` the parameters of every matmul (the LM head included, the embedding lookup not) plus the
attention's ``4 x layers x heads x head_dim x`` keys attended per query (the cache plus, causally,
half the block on average); the engine's own work (re-rotating keys, scoring, compressing) is overhead,
not useful FLOPs, which is what the comparison with the plain forward shows.

Peak memory: on CUDA the most memory torch allocated during the timed blocks; on a CPU the process's
peak resident set during them (Linux resets the high-water mark through ``/proc/self/clear_refs``;
elsewhere it is the peak since the process started), which includes the weights and Python itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcli.errors import KvcliError, UsageError
from kvcli.eval.bench.throughput import stream_plain_blocks, synchronize
from kvcli.kv.architecture import head_shape

_LLAMA = {"rms_norm_eps": 1e-5, "hidden_act": "silu"}


@dataclass(frozen=True)
class Shape:
    """A model shape: the transformers config class (``llama`` or ``qwen2``) and its keyword arguments."""

    family: str
    config: dict
    description: str


#: Named shapes of real models (their published configs, random weights). Llama 3's RoPE scaling is
#: left out: it changes which frequencies rotate a key, not how long anything takes.
SHAPES: dict[str, Shape] = {
    "tiny": Shape("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False,
                                max_position_embeddings=4096, **_LLAMA),
                  "a 2-layer toy for tests (milliseconds per block)"),
    "smollm2-135m": Shape("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                        rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
                                        **_LLAMA),
                          "SmolLM2-135M (kvcli's default model)"),
    "llama-3.2-1b": Shape("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                        rope_theta=500000.0, tie_word_embeddings=True,
                                        max_position_embeddings=131072, **_LLAMA),
                          "Llama-3.2-1B"),
    "llama-3.1-8b": Shape("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                        rope_theta=500000.0, tie_word_embeddings=False,
                                        max_position_embeddings=131072, **_LLAMA),
                          "Llama-3.1-8B"),
    "qwen2.5-7b": Shape("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                      num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                      rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=32768,
                                      rms_norm_eps=1e-6, hidden_act="silu"),
                        "Qwen2.5-7B (biases on q, k and v, as Qwen2 has)"),
}

#: Matmul size for the measured rate: large enough to reach a device's rate, small enough to take well under a second.
MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}

#: Tokens timed per line when the caller does not say: a CPU streams about a thousand tokens/s at 135M.
DEFAULT_TOKENS = {"cuda": 65536, "cpu": 8192}


def shape_config(name: str):
    """The transformers config of shape ``name``."""
    if name not in SHAPES:
        raise UsageError(f"--shape {name!r}: choose one of {', '.join(SHAPES)}")
    shape = SHAPES[name]
    if shape.family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**shape.config)
    from transformers import LlamaConfig

    return LlamaConfig(**shape.config)


def build_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """Shape ``name`` with random weights, allocated on ``device`` in ``dtype`` (never materialised elsewhere),
    its attention running through kvcli's registered function like every model :func:`kvcli.models.load.load_model`
    returns. ``device="meta"`` allocates nothing (to count parameters)."""
    from transformers import AutoModelForCausalLM

    from kvcli.kv.attention import ATTENTION_NAME, register_attention
    from kvcli.models.load import quiet_transformers

    register_attention()
    quiet_transformers()
    config = shape_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


GiB = 2**30


def free_memory(device: torch.device) -> int | None:
    """Bytes ``device`` can still give: a GPU's free memory, a CPU's available memory (Linux's ``MemAvailable``);
    None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_needed(model: torch.nn.Module, dtype: torch.dtype, cache: int, block: int) -> tuple[int, int]:
    """Bytes a run of ``model`` (built on the meta device: nothing allocated) needs: its weights in ``dtype``, and
    the rest at least: the engine's and the plain forward's caches of ``cache + block`` tokens, a block's
    logits in fp32 (twice: their log-softmax) and a block's activations in one layer."""
    from kvcli.engine.engine import kv_bytes_per_token

    config = model.config
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * size
    layer = 4 * config.hidden_size + 3 * (getattr(config, "intermediate_size", None) or 4 * config.hidden_size)
    working = (2 * kv_bytes_per_token(model, dtype) * (cache + block)
               + block * (2 * 4 * config.vocab_size + layer * size))
    return weights, working


def check_memory(shape: str, device: torch.device, dtype: torch.dtype, cache: int, block: int,
                 free: int | None = None) -> None:
    """Refuse, with one line and before anything is allocated, a shape whose weights and working memory do not
    fit in what ``device`` has free (``free``, else measured by :func:`free_memory`)."""
    free = free_memory(device) if free is None else free
    if free is None:
        return
    weights, working = memory_needed(build_model(shape, "meta", dtype), dtype, cache, block)
    if weights + working > free:
        name = str(dtype).removeprefix("torch.")
        raise KvcliError(f"--shape {shape} needs about {(weights + working) / GiB:.1f} GiB ({weights / GiB:.1f} GiB "
                         f"for the weights in {name}, {working / GiB:.1f} GiB to run), and {device} has "
                         f"{free / GiB:.1f} GiB free: choose a smaller shape or a device with more memory")


def matmul_parameters(model: torch.nn.Module) -> int:
    """Weights that multiply activations: every ``Linear`` (the LM head too, even when tied to the embedding),
    not the embedding lookup, norms or biases."""
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def attended_keys(cache: int, block: int) -> float:
    """Keys a query attends to on average when a block of ``block`` tokens runs against ``cache`` cached tokens:
    query ``i`` of the block sees the cache and the block's first ``i + 1`` tokens."""
    return cache + (block + 1) / 2


def flops_per_token(model: torch.nn.Module, keys: float) -> float:
    """Useful FLOPs of one token's forward pass: ``2 x`` matmul parameters plus attention's ``4 x layers x
    heads x head_dim x keys`` (``q @ k`` and ``p @ v``, two FLOPs per multiply-add)."""
    config = model.config
    _, head_dim = head_shape(config)
    attention = 4.0 * config.num_hidden_layers * config.num_attention_heads * head_dim * keys
    return 2.0 * matmul_parameters(model) + attention


def matmul_rate(device: torch.device | str, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a ``size x size`` matmul in ``dtype`` on ``device``, the fastest of ``repeats`` after a warm-up.

    A measured rate (the "peak" MFU is relative to), not the datasheet's: it is what this device, with this
    torch build and this many threads, reaches on the most favourable matmul.
    """
    device = torch.device(device)
    size = size or MATMUL_SIZE.get(device.type, MATMUL_SIZE["cpu"])
    inner = 10 if device.type == "cuda" else 1  # one 8192 matmul is a millisecond on a GPU: time several
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    out = torch.empty(size, size, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=out)
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / inner)
    return 2.0 * size**3 / best


@dataclass
class Timing:
    """One line of the comparison: tokens timed, seconds, and the peak memory while they ran."""

    tokens: int
    seconds: float
    peak_memory_bytes: int
    kv_cache_bytes: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def time_engine(model, method, ids: torch.Tensor, cache: int, block: int) -> Timing:
    """kvcli's engine streaming ``ids[cache + block:]`` after an untimed warm-up over the first ``cache + block``
    tokens (the cache full, one compression done), scoring every token as ``kvcli ppl`` does."""
    from kvcli.engine.engine import Engine
    from kvcli.io.report import peak_memory_bytes, reset_peak_memory

    device = next(model.parameters()).device
    engine = Engine(model, method, cache, block=block)
    kv = engine.new_cache()
    engine.score([ids[:cache + block]], cache=kv)
    synchronize(device)
    reset_peak_memory(device)
    started = time.perf_counter()
    totals = engine.score([ids[cache + block:]], cache=kv)
    synchronize(device)
    seconds = time.perf_counter() - started
    return Timing(totals.processed, seconds, peak_memory_bytes(device), totals.kv_cache_bytes)


def time_plain(model, ids: torch.Tensor, cache: int, block: int) -> Timing:
    """Stock forwards of the same blocks as :func:`time_engine` (``ids[cache + block:]``, the cache filled and
    one block run untimed first)."""
    from kvcli.io.report import peak_memory_bytes, reset_peak_memory

    device = next(model.parameters()).device
    tokens, seconds = stream_plain_blocks(model, ids, block, cache, warmup=1,
                                          before_timing=lambda: reset_peak_memory(device))
    return Timing(tokens, seconds, peak_memory_bytes(device))


def next_token(logits: torch.Tensor) -> int:
    """The greedy next token, read to the host as ``kvcli ask`` reads every sampled token (one read a step)."""
    return int(logits.argmax())


def time_steps(step: Callable[[int], int], token: int, steps: int, device: torch.device) -> Timing:
    """``steps`` calls of ``step`` (a token in, the next token out) after two untimed ones (first-call
    allocations and kernel choices), the device synchronised around the clock, the peak memory of the timed ones."""
    from kvcli.io.report import peak_memory_bytes, reset_peak_memory

    for _ in range(2):
        token = step(token)
    synchronize(device)
    reset_peak_memory(device)
    started = time.perf_counter()
    for _ in range(steps):
        token = step(token)
    synchronize(device)
    return Timing(steps, time.perf_counter() - started, peak_memory_bytes(device))


def time_decode_engine(model, method, ids: torch.Tensor, cache: int, block: int, steps: int,
                       compiled: bool = False) -> Timing:
    """``steps`` greedy one-token steps of kvcli after a read of ``cache + block`` tokens (the cache full,
    compressed once), each step the one ``kvcli ask`` writes with (:func:`kvcli.kv.decode.answer_steps`: the
    engine's compressed forward, or the static step, captured as a CUDA graph on a GPU; ``compiled``: through
    ``torch.compile``, whose compilation falls in the untimed steps)."""
    from kvcli.engine.engine import Engine
    from kvcli.kv.decode import answer_steps

    engine = Engine(model, method, cache, block=block)
    kv = engine.new_cache()
    for start in range(0, cache + block, block):
        hidden = engine.forward(kv, ids[None, start:start + block], last_only=True)
    answer = answer_steps(engine, kv, steps + 2, compiled=compiled)  # time_steps runs two untimed steps first

    def step(token: int) -> int:
        return next_token(answer(token))

    try:
        timing = time_steps(step, next_token(engine.logits(hidden[-1:])[0]), steps, next(model.parameters()).device)
    finally:
        answer.finish()
    timing.kv_cache_bytes = kv.nbytes()
    return timing


def time_decode_plain(model, ids: torch.Tensor, cache: int, steps: int) -> Timing:
    """``steps`` greedy one-token stock forwards (SDPA, ``DynamicCache``) after a one-shot read of ``cache``
    tokens, the cache cropped back to ``cache`` tokens after every step as the engine's stays at its budget."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = ids.to(device)
    model.set_attn_implementation("sdpa")
    try:
        past = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids[None, :cache], past_key_values=past, use_cache=True, logits_to_keep=1)
            position = torch.tensor([[cache]], device=device)

            def step(token: int) -> int:
                logits = model(input_ids=torch.tensor([[token]], device=device), past_key_values=past,
                               use_cache=True, position_ids=position).logits[0, -1]
                past.crop(-1)
                return next_token(logits)

            return time_steps(step, next_token(out.logits[0, -1]), steps, device)
    finally:
        model.set_attn_implementation("kvcli")


def run_speed(shape: str, methods: list, *, cache: int = 1024, block: int | None = None, tokens: int | None = None,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, matmul_size: int | None = None,
              seed: int = 0, decode: int = 0, compile_decode: bool = False,
              note: Callable[[str], None] | None = None) -> dict:
    """Build shape ``shape`` and time a plain forward and kvcli with each of ``methods`` (built
    :class:`kvcli.methods.base.Method` objects) on the same random tokens; one dict for ``--json``.

    ``block`` None is the engine's default for the device, ``tokens`` None :data:`DEFAULT_TOKENS`; the tokens
    timed are rounded down to whole blocks (at least one). ``decode`` > 0 adds lines of that many greedy
    one-token steps against the full cache (plain, then each method): what writing an answer costs;
    ``compile_decode`` runs the methods' static steps through ``torch.compile`` (:class:`kvcli.kv.decode.StaticSteps`).
    """
    from kvcli.engine.engine import default_block

    note = note or (lambda message: None)
    device = torch.device(device)
    block = block or default_block(device)
    tokens = tokens or DEFAULT_TOKENS.get(device.type, DEFAULT_TOKENS["cpu"])
    tokens = max(block, tokens // block * block)
    check_memory(shape, device, dtype, cache, block)
    note(f"building {shape} (random weights) on {device} in {str(dtype).removeprefix('torch.')}")
    model = build_model(shape, device, dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (cache + block + tokens,), generator=generator)
    note(f"measuring the matmul rate ({matmul_size or MATMUL_SIZE.get(device.type, MATMUL_SIZE['cpu'])} square)")
    peak = matmul_rate(device, dtype, matmul_size)
    per_token = flops_per_token(model, attended_keys(cache, block))

    def row(line: str, kind: str, method: str | None, timing: Timing, plain: float | None,
            flops: float = per_token) -> dict:
        speed = timing.tokens_per_second
        return {"line": line, "kind": kind, "method": method, "tokens": timing.tokens, "seconds": timing.seconds,
                "tokens_per_second": speed, "tflops": flops * speed / 1e12, "mfu": flops * speed / peak,
                "vs_plain": speed / plain if plain else None, "peak_memory_bytes": timing.peak_memory_bytes,
                "kv_cache_bytes": timing.kv_cache_bytes}

    note(f"plain forward: {tokens:,} tokens in blocks of {block} against {cache:,} cached tokens")
    plain = time_plain(model, ids, cache, block)
    rows = [row("plain (sdpa)", "plain", None, plain, None)]
    for method in methods:
        note(f"kvcli {method.name}: {tokens:,} tokens")
        timing = time_engine(model, method, ids, cache, block)
        rows.append(row(f"kvcli {method.name}", "engine", method.name, timing, plain.tokens_per_second))
    if decode:
        per_step = flops_per_token(model, cache + 1)  # a step's useful work: one token against the whole cache
        note(f"decode: {decode} one-token steps against {cache:,} cached tokens")
        plain_decode = time_decode_plain(model, ids, cache, decode)
        rows.append(row("decode plain (sdpa)", "decode-plain", None, plain_decode, None, per_step))
        for method in methods:
            note(f"decode kvcli {method.name}: {decode} steps")
            timing = time_decode_engine(model, method, ids, cache, block, decode, compile_decode)
            rows.append(row(f"decode kvcli {method.name}{' (compiled)' if compile_decode else ''}", "decode",
                            method.name, timing,
                            plain_decode.tokens_per_second, per_step))
    config = model.config
    return {
        "shape": shape,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cache": cache,
        "block": block,
        "tokens": tokens,
        "decode_steps": decode,
        "compile_decode": compile_decode,
        "layers": config.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "matmul_parameters": matmul_parameters(model),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "flops_per_token": per_token,
        "matmul_size": matmul_size or MATMUL_SIZE.get(device.type, MATMUL_SIZE["cpu"]),
        "matmul_tflops": peak / 1e12,
        "rows": rows,
    }
