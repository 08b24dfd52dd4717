"""A haystack no kvcli setting was chosen on: Debian's ``fortunes`` collection (quotations, jokes, verse) as plain text.

Each file of ``/usr/share/games/fortunes`` holds short texts separated by lines of a single ``%``. This writes every
file's texts in order (files sorted by name), one blank line between texts, skipping the index files (``*.dat``), the
UTF-8 copies (``*.u8``), the two files of ASCII pictures (``art``, ``ascii-art``) and ``translate-me`` (a note to
translators). A file that is not UTF-8 is read as Latin-1. Usage, on a machine with Debian's archive, no root needed::

    apt-get download fortunes && dpkg-deb -x fortunes_*.deb pkg
    python docs/results/fortunes_haystack.py pkg/usr/share/games/fortunes > fortunes.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

SKIPPED = {"art", "ascii-art", "translate-me"}


def texts(path: Path) -> list[str]:
    """The texts of one fortune file, each stripped of its surrounding blank lines."""
    raw = path.read_bytes()
    try:
        body = raw.decode("utf-8")
    except UnicodeDecodeError:
        body = raw.decode("latin-1")
    pieces, current = [], []
    for line in body.splitlines():
        if line.strip() == "%":
            pieces.append("\n".join(current).strip("\n"))
            current = []
        else:
            current.append(line.rstrip())
    pieces.append("\n".join(current).strip("\n"))
    return [piece for piece in pieces if piece.strip()]


def main(folder: str) -> None:
    files = sorted(p for p in Path(folder).iterdir()
                   if p.is_file() and p.suffix not in (".dat", ".u8") and p.name not in SKIPPED)
    sys.stdout.write("\n\n".join(text for path in files for text in texts(path)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
