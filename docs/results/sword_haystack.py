"""A haystack no kvcli setting was chosen on: a public-domain commentary from Debian's SWORD modules, as plain text.

Debian ships several public-domain English commentaries as SWORD modules (C. H. Spurgeon's *Treasury of David*,
1869-1885, is ``sword-comm-tdavid``; Matthew Henry's *Concise Commentary* is ``sword-comm-mhcc``). A module keeps its
text in zlib blocks (``*.czz``/``*.bzz``) listed by an index of 12-byte entries (offset, size, size unpacked;
``*.czs``/``*.bzs``); the text is OSIS markup. This reads the blocks in order as data, drops the markup (a paragraph's
end becomes a line break) and writes the text; nothing in the module is run. Usage, on a machine with Debian's
archive, no root needed::

    apt-get download sword-comm-tdavid && dpkg-deb -x sword-comm-tdavid_*.deb pkg
    python docs/results/sword_haystack.py pkg/usr/share/sword/modules/comments/zcom/tdavid > tdavid.txt
"""

from __future__ import annotations

import html
import re
import struct
import sys
import zlib
from pathlib import Path

PARAGRAPH_END = re.compile(r'<div eID="[^"]*" type="x-p"/>|</p>|<lb[^>]*/>')
TAG = re.compile(r"<[^>]*>")
SPACES = re.compile(r"[ \t\r\f\v]+")


def blocks(folder: Path, testament: str) -> list[bytes]:
    """The unpacked blocks of one testament's file, in order (an index entry of size 0 is an empty block)."""
    index = next((folder / f"{testament}.{ext}s" for ext in ("cz", "bz") if (folder / f"{testament}.{ext}s").exists()),
                 None)
    if index is None:
        return []
    data = index.with_suffix(index.suffix[:-1] + "z").read_bytes()
    raw = index.read_bytes()
    out = []
    for at in range(0, len(raw) - len(raw) % 12, 12):
        offset, size, _ = struct.unpack("<III", raw[at:at + 12])
        if size:
            out.append(zlib.decompress(data[offset:offset + size]))
    return out


def plain(osis: str) -> str:
    """OSIS markup as text: paragraphs on lines of their own, tags dropped, entities decoded, spaces collapsed."""
    text = html.unescape(TAG.sub(" ", PARAGRAPH_END.sub("\n", osis)))
    lines = (SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def main(folder: str) -> None:
    path = Path(folder)
    osis = b"".join(block for testament in ("ot", "nt") for block in blocks(path, testament))
    if not osis:
        sys.exit(f"no SWORD compressed blocks (ot.czs/ot.bzs) in {folder}")
    sys.stdout.write(plain(osis.decode("utf-8", errors="replace")) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
