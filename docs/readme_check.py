"""Check that every example output in the README is what its command prints today.

Usage: ``python docs/readme_check.py [FILE.md ...] [--update]`` from the repository root (default: README.md).

An example is a fenced ``console`` block: a line ``$ kvcli ...`` and, under it, what the command prints on
stdout. Each command is run as written (``kvcli`` as ``python -m kvcli``, in the repository root) and its
stdout compared with the block, line by line, after :func:`steady` has masked what changes from run to run
and machine to machine (seconds, tokens/s, peak memory). Any other difference is drift: the script prints
it and exits 1. ``--update`` writes what the commands print into the blocks instead (steady parts and all).

The default model's example reads 8,192 tokens (about a minute on a 2-core CPU), so the test suite runs this
check only with ``--run-slow`` (tests/test_readme.py); its fast test checks the blocks' format against a
tiny model's output.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What varies between runs of the same command: replaced by a placeholder on both sides of the comparison.
VOLATILE = [
    (re.compile(r"peak memory [\d,.]+ [KMG]iB"), "peak memory <memory>"),
    (re.compile(r"^[\d,.]+ s · [\d,.]+ tokens/s"), "<seconds> s · <rate> tokens/s"),
]


@dataclass
class Example:
    """One ``console`` block: its command, the output it shows, and where the output lines are in the file."""

    command: str
    shown: list[str]
    first: int  # index of the first output line in the file's lines
    end: int  # index after the last one


def examples(text: str) -> list[Example]:
    """The ``$ kvcli ...`` examples of a Markdown text's ``console`` blocks."""
    lines = text.split("\n")
    found: list[Example] = []
    inside = False
    for index, line in enumerate(lines):
        if line.strip() == "```console":
            inside = True
        elif line.strip() == "```" and inside:
            inside = False
            if found and found[-1].end == -1:
                found[-1].end = index
        elif inside and line.startswith("$ kvcli "):
            if found and found[-1].end == -1:
                found[-1].end = index
            found.append(Example(line[2:], [], index + 1, -1))
        elif inside and found and found[-1].end == -1:
            found[-1].shown.append(line)
    return found


def steady(line: str) -> str:
    """``line`` with what varies between runs masked (:data:`VOLATILE`)."""
    for pattern, placeholder in VOLATILE:
        line = pattern.sub(placeholder, line)
    return line.rstrip()


def run(command: str) -> list[str]:
    """What ``command`` prints on stdout, run from the repository root with this Python's kvcli."""
    args = shlex.split(command)
    if args[0] != "kvcli":
        raise ValueError(f"not a kvcli command: {command}")
    done = subprocess.run([sys.executable, "-m", "kvcli", *args[1:]], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{command!r} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout.rstrip("\n").split("\n")


def drift(shown: list[str], printed: list[str]) -> list[str]:
    """The lines where the shown output and the printed one differ once steadied (empty: none)."""
    out = []
    for number in range(max(len(shown), len(printed))):
        a = steady(shown[number]) if number < len(shown) else "<missing>"
        b = steady(printed[number]) if number < len(printed) else "<missing>"
        if a != b:
            out.append(f"  line {number + 1}: shown   {a}\n  line {number + 1}: printed {b}")
    return out


def check(path: Path, update: bool) -> int:
    """Run every example of ``path``; the number that drifted (or, with ``update``, were rewritten)."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    changed = 0
    for example in reversed(examples(text)):  # from the end, so that earlier line numbers stay right
        printed = run(example.command)
        problems = drift(example.shown, printed)
        if not problems:
            print(f"ok    {path.name}: $ {example.command}")
            continue
        changed += 1
        if update:
            lines[example.first:example.end] = printed
            print(f"wrote {path.name}: $ {example.command}")
        else:
            print(f"DRIFT {path.name}: $ {example.command}\n" + "\n".join(problems))
    if update and changed:
        path.write_text("\n".join(lines), encoding="utf-8")
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, default=[ROOT / "README.md"])
    parser.add_argument("--update", action="store_true", help="write what the commands print into the blocks")
    args = parser.parse_args()
    drifted = sum(check(path, args.update) for path in args.files)
    sys.exit(1 if drifted and not args.update else 0)


if __name__ == "__main__":
    main()
