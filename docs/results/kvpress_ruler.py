"""kvpress's presses on the RULER samples ``kvcli ruler --export`` writes, graded by kvcli's grader (issue 53).

Run it with kvpress's own environment, not kvcli's (kvpress 0.5.5 pins transformers < 5.3)::

    kvcli ruler BOOK --tasks niah_single_2,vt --lengths 4k --samples 2 --export samples.jsonl
    /path/to/kvpress-venv/bin/python docs/results/kvpress_ruler.py samples.jsonl --out kvpress.jsonl \\
        --presses SnapKVPress,StreamingLLMPress --ratios 0.5,0.875 --model-dir ~/.cache/kvcli/models/SmolLM2-...

Every sample is read by kvpress's ``kv-press-text-generation`` pipeline with each press at each ratio: the chat
template's opening and the sample's ``context`` are prefilled and compressed, the ``question`` (with the end of
the user's turn, the assistant's start and the ``answer_prefix``) is appended whole, and the answer is written
greedily up to the sample's ``answer_tokens``. Its score is kvcli's :func:`kvcli.eval.ruler.recall`, imported
from the kvcli source folder this file sits in (never copied). One JSON line per trial, the fields of kvcli's
trial rows where they apply (task, length, index, method ``kvpress:<Press>``, ratio, outputs, answer, score,
prompt_tokens, seconds) plus the tokens kvpress compressed and kept and the trial's peak resident set; ``run``
says what produced the row, and a second run with the same ``--out`` takes the rows of the same run and reads
only the rest. docs/ruler.md ("kvpress side by side") says what kvpress sees and what kvcli sees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the kvcli source folder: its grader and writers

#: Presses that leave layers of different lengths. transformers builds one attention mask for every layer from
#: layer 0's cache length (huggingface/transformers#35168), so the question's forward after such a press fails
#: under SDPA's mask on a CPU (kvpress needs flash attention for them). They run with :func:`own_mask_attention`,
#: as every press does on a model with sliding-window layers (Gemma 3), whose windowed layers are not compressed.
UNEVEN_PRESSES = ("PyramidKVPress",)
PRESSES = ("SnapKVPress", "PyramidKVPress", "StreamingLLMPress", "TOVAPress", "ExpectedAttentionPress", "KVzipPress")
FIELDS = ("task", "length", "index", "context", "question", "answer_prefix", "outputs", "answer_tokens")


def fail(message: str) -> None:
    """One line on stderr and exit code 2, as kvcli refuses bad input."""
    print(f"kvpress_ruler: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_samples(path: Path) -> list[dict]:
    """The lines of ``kvcli ruler --export``; anything else is refused in one line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {path}: {exc}")
    samples = []
    for number, line in enumerate(lines, start=1):
        try:
            sample = json.loads(line)
        except ValueError:
            sample = None
        if not isinstance(sample, dict) or any(key not in sample for key in FIELDS):
            fail(f"{path} line {number} is not a sample of `kvcli ruler --export`")
        samples.append(sample)
    if not samples:
        fail(f"{path} holds no samples")
    return samples


def parse_options(items: list[str]) -> dict[str, dict]:
    """``--press-option PRESS.KEY=VALUE`` (repeatable) as ``{press: {key: value}}``; a value is read as JSON
    (``64``, ``true``, ``0.1``) or else kept as text."""
    options: dict[str, dict] = {}
    for item in items:
        name, _, value = item.partition("=")
        press, _, key = name.partition(".")
        if not value or not key or press not in PRESSES:
            fail(f"--press-option {item!r}: expected PRESS.KEY=VALUE with PRESS one of {', '.join(PRESSES)}")
        try:
            options.setdefault(press, {})[key] = json.loads(value)
        except ValueError:
            options.setdefault(press, {})[key] = value
    return options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("samples", type=Path, help="the JSON lines of `kvcli ruler --export`")
    parser.add_argument("--out", type=Path, required=True, help="rows, one JSON line per trial; resumed if there")
    parser.add_argument("--model-dir", type=Path, required=True,
                        help="the weights kvcli reads: its model cache folder (config.json, model.safetensors, "
                             "tokenizer files), e.g. ~/.cache/kvcli/models/SmolLM2-135M-Instruct.Q4_1-float32-*")
    parser.add_argument("--presses", default="SnapKVPress,StreamingLLMPress", help=f"of: {','.join(PRESSES)}")
    parser.add_argument("--ratios", default="0.5,0.75,0.875", help="kvpress's compression_ratio values (0: the "
                        "pipeline's prefill uncompressed, its full attention)")
    parser.add_argument("--press-option", action="append", default=[], metavar="PRESS.KEY=VALUE")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' and activations' dtype: the one kvcli's run used (`kvcli ruler --dtype`)")
    args = parser.parse_args(argv)
    args.presses = [name.strip() for name in args.presses.split(",") if name.strip()]
    for name in args.presses:
        if name not in PRESSES:
            fail(f"--presses: unknown press {name!r}; choose from {', '.join(PRESSES)}")
    try:
        args.ratios = [float(r) for r in args.ratios.split(",")]
    except ValueError:
        fail(f"--ratios {args.ratios!r}: expected numbers such as 0.5,0.75")
    if not all(0 <= r < 1 for r in args.ratios):
        fail("--ratios: a compression ratio is at least 0 (kvpress's pipeline without compression) and less than 1")
    if not (args.model_dir / "config.json").is_file():
        fail(f"--model-dir {args.model_dir}: no config.json there (give kvcli's model cache folder)")
    args.options = parse_options(args.press_option)
    return args


def load(model_dir: Path, dtype: str):
    """kvpress's pipeline on the weights and tokenizer of ``model_dir`` in ``dtype``, on the CPU, no network."""
    import kvpress  # noqa: F401 - registers the "kv-press-text-generation" pipeline
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=getattr(torch, dtype))
    model.eval()
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def run_identity(args: argparse.Namespace, pipe, samples: list[dict]) -> dict:
    """What a row was produced by: a resumed row must come from the same samples, weights and versions."""
    import kvpress
    import torch
    import transformers

    template = pipe.tokenizer.chat_template
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest() if isinstance(template, str) else None
    exported = {sample.get("chat_template_sha256") for sample in samples}
    if exported != {digest}:
        fail(f"the samples were sized with another chat template ({', '.join(map(str, exported))}) than "
             f"{args.model_dir}'s ({digest}): export them with the model of these weights")
    weights = args.model_dir / "model.safetensors"
    return {"samples_sha256": hashlib.sha256(args.samples.read_bytes()).hexdigest(),
            "model_dir": args.model_dir.name, "weights_bytes": weights.stat().st_size if weights.exists() else None,
            "chat_template_sha256": digest, "book_sha256": samples[0].get("book_sha256"),
            "kvpress": getattr(kvpress, "__version__", "0.5.5"), "transformers": transformers.__version__,
            "torch": torch.__version__, "options": args.options,
            **({"dtype": args.dtype} if args.dtype != "float32" else {})}


def trial(pipe, sample: dict, press_name: str, ratio: float, options: dict) -> dict:
    """One sample read by one press at one ratio, graded with kvcli's grader; the trial's own peak RSS."""
    import kvpress
    import torch
    from transformers import DynamicCache

    from kvcli.eval.ruler import recall
    from kvcli.io.report import peak_memory_bytes, reset_peak_memory

    # ratio 0 is the pipeline's plain prefill (no press at all), the same read whichever press is named
    press = getattr(kvpress, press_name)(compression_ratio=ratio, **options) if ratio > 0 else None
    if press is not None and windowed_layers(pipe):
        press.forward_hook = skipping_windowed_layers(press.forward_hook)
    attention_for(pipe, press_name)
    ids = pipe.preprocess(sample["context"], [sample["question"]], sample["answer_prefix"], int(1e10))
    cache = DynamicCache()
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    started = time.perf_counter()
    answer = pipe(sample["context"], question=sample["question"], answer_prefix=sample["answer_prefix"],
                  press=press, max_new_tokens=sample["answer_tokens"], cache=cache)["answer"].strip()
    seconds = time.perf_counter() - started
    kept = kept_tokens(pipe, cache)
    return {"task": sample["task"], "length": sample["length"], "index": sample["index"],
            "method": f"kvpress:{press_name}", "ratio": ratio, "outputs": sample["outputs"], "answer": answer,
            "score": recall(answer, sample["outputs"]),
            "prompt_tokens": ids["context_ids"].shape[1] + ids["questions_ids"][0].shape[1],
            "context_tokens": ids["context_ids"].shape[1], "question_tokens": ids["questions_ids"][0].shape[1],
            "kept_tokens": round(sum(kept) / len(kept)), "seconds": seconds, "peak_rss_bytes": peak_memory_bytes(cpu)}


def kept_tokens(pipe, cache) -> list[float]:
    """Tokens each layer keeps of the context, on average over its KV heads. The pipeline cut the answer off the
    cache, so its length is the context kept; a press that masks instead of dropping (KVzip, AdaKV: kvpress's
    ``masked_key_indices``, read by its attention patch) keeps its masked entries in the cache, and they are not
    counted as kept."""
    out = []
    for layer, block in zip(cache.layers, pipe.model.model.layers, strict=True):
        if windowed(block.self_attn):
            continue  # a windowed layer is never compressed (kvpress's rule for Gemma 3); kvcli's budget skips it too
        batch, heads, length = layer.keys.shape[:3]
        masked = getattr(block.self_attn, "masked_key_indices", None)
        out.append(length - (len(masked[0]) / (batch * heads) if masked is not None else 0))
    return out


def windowed(attention) -> bool:
    """Whether an attention module is a sliding-window layer (Gemma 3's local layers say ``is_sliding``)."""
    return bool(getattr(attention, "is_sliding", False))


def windowed_layers(pipe) -> bool:
    """Whether the model has sliding-window layers."""
    return any(windowed(block.self_attn) for block in pipe.model.model.layers)


def skipping_windowed_layers(hook):
    """A press's forward hook that leaves sliding-window layers alone. kvpress 0.5.5 skips them for
    ``Gemma3ForConditionalGeneration`` (its ``BasePress.__call__``) but compresses them in Gemma 3's text-only
    ``Gemma3ForCausalLM`` (which it calls "not tested"), after which a local layer's window mask no longer matches
    its cache and the answer is noise; kvcli's windowed layers also keep their window whatever the budget."""

    def forward_hook(module, input, kwargs, output):
        return output if windowed(module) else hook(module, input, kwargs, output)

    return forward_hook


def own_mask(q_len: int, k_len: int, sliding_window: int | None, device):
    """The mask of a layer's own cache, in cache indices: the new queries are its last ``q_len`` entries, each sees
    every earlier entry and itself, and on a windowed layer (never compressed, so an index is a position) only the
    ``sliding_window - 1`` entries before it (transformers' sliding mask). None where that is every entry."""
    import torch

    if q_len == 1 and not sliding_window:
        return None
    queries = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    keys = torch.arange(k_len, device=device)[None, :]
    mask = keys <= queries
    if sliding_window:
        mask &= queries - keys < sliding_window
    return mask[None, None]


def own_mask_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention with the mask this layer's own cache needs (:func:`own_mask`), not the one
    built from another layer's cache length."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = own_mask(query.shape[2], key.shape[2], kwargs.get("sliding_window"), query.device)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=False,
                                  **{k: v for k, v in kwargs.items() if k not in ("is_causal", "sliding_window")})


def attention_for(pipe, press_name: str) -> None:
    """The attention a press's trial runs with: ``own_mask_attention`` for :data:`UNEVEN_PRESSES` and on a model
    with windowed layers (its compressed and windowed layers differ in length), else SDPA."""
    from transformers import AttentionInterface

    AttentionInterface.register("kvpress_ruler_own_mask", own_mask_attention)
    own = press_name in UNEVEN_PRESSES or windowed_layers(pipe)
    pipe.model.set_attn_implementation("kvpress_ruler_own_mask" if own else "sdpa")


def taken_rows(log, run: dict) -> dict[tuple, dict]:
    """The rows already in ``--out``, by (task, length, index, method, ratio); a row of another run is refused."""
    done = {}
    for row in log.start(resume=True, required="task"):
        if row.get("run") != run:
            fail(f"--out {log.path} holds rows of another run (samples, weights, versions or options differ): "
                 "choose another file")
        done[(row["task"], row["length"], row["index"], row["method"], row["ratio"])] = row
    return done


def main(argv: list[str] | None = None) -> None:
    from kvcli.errors import KvcliError
    from kvcli.io.outputs import RowLog

    args = parse_args(argv)
    samples = read_samples(args.samples)
    try:
        log = RowLog(args.out, "--out")
    except KvcliError as exc:
        fail(str(exc))
    pipe = load(args.model_dir, args.dtype)
    run = run_identity(args, pipe, samples)
    done = taken_rows(log, run)
    grid = [(sample, press, ratio) for sample in samples for press in args.presses for ratio in args.ratios]
    keys = [(s["task"], s["length"], s["index"], f"kvpress:{press}", ratio) for s, press, ratio in grid]
    print(f"took {sum(key in done for key in keys)} of {len(grid)} trials from {args.out}", file=sys.stderr)
    try:
        for (sample, press, ratio), key in zip(grid, keys, strict=True):
            if key not in done:
                one(pipe, log, sample, press, ratio, args.options.get(press, {}), run)
    except KvcliError as exc:  # --out could not be written (a full disk): the rows before are whole
        print(f"kvpress_ruler: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"kvpress_ruler: stopped; the finished trials are in {args.out}: the same command continues",
              file=sys.stderr)
        raise SystemExit(130) from None


def one(pipe, log, sample: dict, press: str, ratio: float, options: dict, run: dict) -> None:
    """One trial written to ``--out`` and printed; a failure of kvpress is one line and exit code 1."""
    try:
        row = {**trial(pipe, sample, press, ratio, options), "run": run}
    except Exception as exc:  # noqa: BLE001 - kvpress's own failure: one line, the rows so far are kept
        print(f"kvpress_ruler: error: kvpress:{press} at ratio {ratio:g} failed on {sample['task']} sample "
              f"{sample['index']} at {sample['length']:,} tokens: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        raise SystemExit(1) from None
    log.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "run"}), flush=True)


if __name__ == "__main__":
    main()
