"""Issue #56's corpus check: a folder of short documents scored one at a time and batched (`kvcli ppl --batch`).

Usage: ``python docs/results/documents_batch.py TOKENIZER_DIR [--documents 1000] [--shape smollm2-135m]
[--method snapkv] [--cache 1024] [--batches 1,auto] [--out FOLDER]``. It builds a random-weight model of the shape
(speed does not depend on the weights; ``kvcli bench-speed``'s shapes) with the tokenizer of TOKENIZER_DIR (for
example the SmolLM2 folder of ``~/.cache/kvcli/models``, carried as an ignored folder to a GPU machine), writes
``--documents`` documents of 2,000-8,000 of its vocabulary's words (a little more in tokens), and runs
``kvcli ppl FOLDER --json`` once per ``--batches`` entry, as a user types it. It prints one JSON line per run
(documents, tokens, seconds, tokens/s of the job, peak memory, the batch ``auto`` chose) and then whether every
document's tokens, bytes and cache bytes are equal across the runs and the largest relative difference of a
document's perplexity.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path


def build_model(shape: str, tokenizer_dir: Path, out: Path) -> None:
    """A random model of ``shape`` with the tokenizer of ``tokenizer_dir``, saved to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcli.eval.bench.speed import shape_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = shape_config(shape)
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_documents(tokenizer_dir: Path, folder: Path, count: int, seed: int = 0) -> None:
    """``count`` documents of 2,000-8,000 of the tokenizer's plain words each (a word is a token or two)."""
    from transformers import AutoTokenizer

    vocab = [w for w in AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab() if w.isalpha() and w.isascii()]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        words = rng.choices(vocab, k=rng.randint(2000, 8000))
        (folder / f"doc{i:05d}.txt").write_text(" ".join(words), encoding="utf-8")


def run(model: Path, folder: Path, method: str, cache: int, batch: str) -> tuple[dict, dict]:
    """``kvcli ppl FOLDER --batch BATCH --json`` as a user types it: its summary line and its JSON."""
    command = [sys.executable, "-m", "kvcli", "ppl", str(folder), "--model", str(model), "--method", method,
               "--cache", str(cache), "--batch", batch, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    chosen = [line for line in done.stderr.splitlines() if "--batch auto" in line]
    job = result["job"]
    line = {"batch": batch, "chosen": chosen[0] if chosen else None, "documents": job["documents"],
            "tokens": job["tokens"], "seconds": round(job["seconds"], 2),
            "tokens_per_second": round(job["tokens_per_second"], 1), "peak_memory_bytes": result["peak_memory_bytes"],
            "device": result["device"], "dtype": result["dtype"]}
    return line, result


def compare(results: list[dict]) -> dict:
    """Whether every document's counts agree across the runs, and the largest relative perplexity difference."""
    first = results[0]["documents"]
    same = all([(d["tokens"], d["bytes"], d["kv_cache_bytes"]) for d in r["documents"]]
               == [(d["tokens"], d["bytes"], d["kv_cache_bytes"]) for d in first] for r in results[1:])
    worst = max((abs(d["ppl"] - e["ppl"]) / e["ppl"] for r in results[1:] for d, e in zip(r["documents"], first,
                                                                                           strict=True)), default=0.0)
    return {"same_counts": same, "max_relative_ppl_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_dir", type=Path)
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--cache", type=int, default=1024)
    parser.add_argument("--batches", default="1,auto")
    parser.add_argument("--out", type=Path, default=None, help="folder for the model and documents (default: temp)")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="kvcli-documents-"))
    build_model(args.shape, args.tokenizer_dir, work / "model")
    write_documents(args.tokenizer_dir, work / "documents", args.documents)
    results = []
    for batch in args.batches.split(","):
        line, result = run(work / "model", work / "documents", args.method, args.cache, batch)
        print(json.dumps(line), flush=True)
        results.append(result)
    print(json.dumps(compare(results)))


if __name__ == "__main__":
    main()
