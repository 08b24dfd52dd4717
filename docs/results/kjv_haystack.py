"""A haystack for RULER that no kvcli setting was chosen on: the King James Bible, from Debian's ``bible-kjv``.

The book is public domain and ships as Debian's ``bible-kjv-text`` (data) and ``bible-kjv`` (the reader); neither
needs root::

    apt-get download bible-kjv bible-kjv-text && for d in bible-kjv*.deb; do dpkg -x "$d" kjv; done
    kjv/usr/bin/bible -p kjv/usr/lib "Gen1:1-Rev22:21" | python docs/results/kjv_haystack.py > kjv.txt

Verse numbers and chapter headings are dropped (RULER's values are numbers: the haystack holds none), each
chapter becomes one paragraph, the verses joined by spaces.
"""

from __future__ import annotations

import re
import sys

VERSE = re.compile(r"^\s+\d+ ")


def chapters(lines: list[str]) -> list[str]:
    """The chapters' texts: runs of lines between blank lines, a lone heading line ("Genesis 1") skipped."""
    out, run = [], []
    for line in [*lines, ""]:
        if line.strip():
            run.append(line)
            continue
        if len(run) > 1 or (run and VERSE.match(run[0])):
            out.append(" ".join(VERSE.sub("", part).strip() for part in run))
        run = []
    return out


if __name__ == "__main__":
    sys.stdout.write("\n\n".join(chapters(sys.stdin.read().splitlines())) + "\n")
