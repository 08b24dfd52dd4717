"""Every method at several ``--kv-bits`` in the same bytes: ``kvcli ppl`` as a user types it, one run per cell.

    python docs/results/kv_bits_table.py BOOK --rows rows.jsonl \
        --methods treekv,snapkv,pod:select=snapkv --bits 16,4,2 --cache-bytes 11.25MiB --max-tokens 16384

Each finished run is appended to ``--rows`` as one JSON line (``kvcli ppl --json`` plus the cell), so a killed run
continues where it stopped; the Markdown table (tokens per layer, perplexity, change against 16 bits, bytes held)
is printed at the end; tokens are the budget per layer (a mean over layers where a method varies it).
``METHOD:KEY=VALUE`` passes ``-o KEY=VALUE`` (PoD's selection).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run_cell(book: str, method: str, bits: int, args: argparse.Namespace) -> dict | None:
    """One ``kvcli ppl`` run; None (its error on stderr) if it failed, so the other cells still run."""
    name, _, option = method.partition(":")
    command = ["kvcli", "ppl", book, "--method", name, "--cache-bytes", args.cache_bytes, "--kv-bits", str(bits),
               "--max-tokens", str(args.max_tokens), "--model", args.model, "--json", "--quiet"]
    if option:
        command += ["-o", option]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        print(f"{' '.join(command)} failed: {done.stderr.strip()}", file=sys.stderr)
        return None
    return {"cell": [method, bits], **json.loads(done.stdout)}


def table(rows: dict, methods: list[str], bits: list[int]) -> str:
    lines = ["| method | " + " | ".join(f"{b} bits: tokens, perplexity" for b in bits) + " | largest kv_cache_bytes |",
             "|---|" + "---|" * len(bits) + "---:|"]
    for method in methods:
        base = rows.get((method, 16))
        cells, largest = [], 0
        for b in bits:
            row = rows.get((method, b))
            if row is None:
                cells.append("not run")
                continue
            largest = max(largest, row["kv_cache_bytes"])
            text = f"{row['cache']:,}, {row['ppl']:.3f}"
            if base is not None and b != 16:
                text = (f"{row['cache']:,} ({row['cache'] / base['cache']:.2f}x), "
                        f"{row['ppl']:.3f} ({100 * (row['ppl'] / base['ppl'] - 1):+.1f} %)")
            cells.append(text)
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {largest:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("book")
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--methods", default="streamingllm,h2o,tova,snapkv,pyramidkv,pyramidinfer,treekv,"
                                              "pod:select=snapkv")
    parser.add_argument("--bits", default="16,4,2")
    parser.add_argument("--cache-bytes", default="11.25MiB")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    methods, bits = args.methods.split(","), [int(b) for b in args.bits.split(",")]
    rows = {}
    if args.rows.exists():
        for line in args.rows.read_text().splitlines():
            row = json.loads(line)
            rows[tuple(row["cell"])] = row
    for method in methods:
        for b in bits:
            if (method, b) in rows:
                continue
            row = run_cell(args.book, method, b, args)
            if row is None:
                continue
            rows[(method, b)] = row
            with args.rows.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(f"{method} {b} bits: {row['cache']} tokens, ppl {row['ppl']:.3f}", file=sys.stderr)
    print(table(rows, methods, bits))


if __name__ == "__main__":
    main()
