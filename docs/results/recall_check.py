"""Six keyed facts in a book, read once, asked from the saved read with and without --recall (issue #54).

    python docs/results/recall_check.py build BOOK.txt haystack.txt keys.json [CHARS [SEED [START]]]  # 100,000, 30 %
    kvcli read haystack.txt --out h.kvc --method snapkv --cache 1024
    kvcli ask h.kvc "What is the pass key for the red door?" ... --recall 512 --json > answers.json
    python docs/results/recall_check.py score keys.json answers.json ...

A key counts only when the answer writes it as a whole run of digits (never a substring). RULER's multi-key kind:
"The pass key for the NAME is KEY." at 10, 25, 40, 55, 70 and 85 % of the text, each in a paragraph of its own.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

NAMES = ["red door", "blue box", "old bridge", "green lamp", "iron gate", "silver cup"]
DEPTHS = [0.10, 0.25, 0.40, 0.55, 0.70, 0.85]


def build(book: str, out: str, keys_out: str, chars: int = 100_000, seed: int = 2026, start_at: float = 0.3) -> None:
    """``chars`` characters of ``book`` from the share ``start_at`` of it on, six keys put in (same seed, same file)."""
    text = Path(book).read_text(encoding="utf-8")
    start = int(len(text) * start_at)
    text = text[start:start + chars]
    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in NAMES]
    parts, last = [], 0
    for name, key, depth in zip(NAMES, keys, DEPTHS, strict=True):
        at = text.find("\n\n", int(len(text) * depth))
        parts += [text[last:at], f"\n\nThe pass key for the {name} is {key}. Remember it.\n\n"]
        last = at
    parts.append(text[last:])
    Path(out).write_text("".join(parts), encoding="utf-8")
    Path(keys_out).write_text(json.dumps(dict(zip(NAMES, keys, strict=True))))


def score(keys_path: str, answers: list[str]) -> None:
    keys = json.loads(Path(keys_path).read_text())
    for path in answers:
        rows = json.loads(Path(path).read_text())["answers"]
        hits = [keys[row["question"].split("for the ")[1].rstrip("?")] in re.findall(r"\d+", row["answer"])
                for row in rows]
        seconds = sum(row["seconds"] for row in rows) / len(rows)
        print(f"{path}: {sum(hits)}/{len(hits)} keys, {seconds:.1f} s a question, recall tokens "
              f"{[row.get('recall_tokens', 0) for row in rows]}")


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(*sys.argv[2:5], *map(int, sys.argv[5:7]), *map(float, sys.argv[7:8]))
    else:
        score(sys.argv[2], sys.argv[3:])
