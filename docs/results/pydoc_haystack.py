"""A haystack no kvcli setting was chosen on: the prose of Python 3.11's documentation as Debian ships it.

Debian's ``python3.11-doc`` holds the reStructuredText source of every page beside its HTML
(``html/_sources/**/*.rst.txt``). This writes, as they are (markup included), the pages of the tutorial, the
language reference, the HOWTOs and the FAQ, in that order and each folder's pages sorted by path, a blank line
between pages: technical English with code, unlike the novels kvcli was tuned on (its size: the notes). Usage, on a
machine with Debian's archive, no root needed::

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb pkg
    python docs/results/pydoc_haystack.py pkg/usr/share/doc/python3.11/html/_sources > pydoc.txt
    python docs/results/pydoc_haystack.py pkg/usr/share/doc/python3.11/html/_sources library > pylib.txt

Folders named after the sources are written instead of the four above: ``library`` (the standard library's
reference, a sixth held-out text) shares no page with them.
"""

from __future__ import annotations

import sys
from pathlib import Path

FOLDERS = ("tutorial", "reference", "howto", "faq")


def main(sources: str, folders: tuple[str, ...] = FOLDERS) -> None:
    root = Path(sources)
    pages = [path for folder in folders for path in sorted((root / folder).rglob("*.rst.txt"))]
    sys.stdout.write("\n\n".join(path.read_text(encoding="utf-8").strip("\n") for path in pages) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or FOLDERS)
