"""Jane Austen's six novels as text files, from Debian's ``r-cran-janeaustenr`` package: haystacks kvcli never read.

The package holds Project Gutenberg's texts as R data (one string per line, in a lazy-load database). This reads the
database's index and strings directly, as data: R's serialization format (XDR), the few types these files use; no
R code is run and nothing is unpickled. Usage, on a machine with Debian's archive::

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python docs/results/austen_books.py pkg/usr/lib/R/site-library/janeaustenr/data OUT_FOLDER

writes ``emma.txt``, ``persuasion.txt``, ... (the lines joined with newlines), each replaced whole.
"""

from __future__ import annotations

import gzip
import struct
import sys
import zlib
from pathlib import Path

from kvcli.io.outputs import replace_file

NIL, SYMBOL, PAIRLIST, CHARS, LOGICALS, INTS, STRINGS, LIST, REF = 254, 1, 2, 9, 10, 13, 16, 19, 255


class XDR:
    """A reader of R's XDR serialization: enough for a lazy-load index (named lists of integer pairs, a logical)
    and a character vector."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not R's XDR serialization")
        self.data, self.at, self.symbols = data, 2, []
        version = self.int()
        self.at += 8 if version == 2 else 8 + 4 + self.int_at(self.at + 8)  # writer and reader versions, encoding

    def int_at(self, at: int) -> int:
        return struct.unpack(">i", self.data[at:at + 4])[0]

    def int(self) -> int:
        value = self.int_at(self.at)
        self.at += 4
        return value

    def item(self):
        flags = self.int()
        kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == NIL:
            return None
        if kind == REF:
            return self.symbols[(flags >> 8) - 1]
        if kind == SYMBOL:
            self.symbols.append(self.item())
            return self.symbols[-1]
        if kind == PAIRLIST:  # attributes: (tag, value) pairs
            pairs = {}
            while kind == PAIRLIST:
                if has_attributes:
                    self.item()
                tag = self.item() if has_tag else None
                pairs[tag] = self.item()
                flags = self.int()
                kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            return pairs
        if kind == CHARS:
            length = self.int()
            if length == -1:
                return ""
            text = self.data[self.at:self.at + length].decode("utf-8")
            self.at += length
            return text
        length = self.int()
        if kind in (LOGICALS, INTS):
            value = list(struct.unpack(f">{length}i", self.data[self.at:self.at + 4 * length]))
            self.at += 4 * length
        elif kind in (STRINGS, LIST):
            value = [self.item() for _ in range(length)]
        else:
            raise ValueError(f"R type {kind} is not one this reader knows")
        if has_attributes:
            names = self.item().get("names")
            if names is not None:
                return dict(zip(names, value, strict=True))
        return value


def books(folder: Path) -> dict[str, str]:
    """Every character vector of the package's data, by name, its lines joined with newlines."""
    index = XDR(gzip.decompress((folder / "Rdata.rdx").read_bytes())).item()
    database = (folder / "Rdata.rdb").read_bytes()
    texts = {}
    for name, (offset, length) in index["variables"].items():
        chunk = database[offset:offset + length]
        lines = XDR(zlib.decompress(chunk[4:])).item()  # 4 bytes: the serialized length
        texts[name] = "\n".join(lines)
    return texts


if __name__ == "__main__":
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in books(source).items():
        replace_file(out / f"{name}.txt", text.encode("utf-8"))  # a link there is replaced, never written through
        print(f"{name}.txt: {len(text):,} characters", file=sys.stderr)
