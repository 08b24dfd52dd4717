"""docs/results/austen_books.py reads R's serialized strings as data: a lazy-load database written here by hand."""

import gzip
import struct
import subprocess
import sys
import zlib
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "docs" / "results" / "austen_books.py"


def ints(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def chars(text: str) -> bytes:
    data = text.encode("utf-8")
    return ints(9 | (1 << 15), len(data)) + data  # a CHARSXP in UTF-8


def strings(*texts: str) -> bytes:
    return ints(16, len(texts)) + b"".join(chars(text) for text in texts)


def serialized(body: bytes) -> bytes:
    return b"X\n" + ints(3, 263170, 197888, 5) + b"UTF-8" + body


def named(values: bytes, count: int, names: bytes) -> bytes:
    """A list of ``count`` items with a names attribute (``names``: the symbol, then the STRSXP of names)."""
    return ints(19 | (1 << 9), count) + values + ints(2 | (1 << 10)) + names + ints(254)


def test_the_books_come_out_of_an_r_lazy_load_database_line_by_line(tmp_path):
    emma = serialized(strings("EMMA", "", "By Jane Austen"))
    persuasion = serialized(strings("Persuasion"))
    database = b""
    spans = []
    for body in (emma, persuasion):
        chunk = struct.pack(">I", len(body)) + zlib.compress(body)
        spans.append((len(database), len(chunk)))
        database += chunk
    names_symbol = ints(1) + chars("names")
    variables = named(ints(13, 2, *spans[0]) + ints(13, 2, *spans[1]), 2,
                      names_symbol + strings("emma", "persuasion"))
    index = serialized(named(variables + ints(10, 1, 1), 2, ints((1 << 8) | 255) + strings("variables", "compressed")))
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))
    (tmp_path / "Rdata.rdb").write_bytes(database)
    target = tmp_path / "kept.txt"
    target.write_text("not a book")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "emma.txt").symlink_to(target)  # a link at an output is replaced, never written through
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    assert (tmp_path / "out" / "emma.txt").read_text() == "EMMA\n\nBy Jane Austen"
    assert (tmp_path / "out" / "persuasion.txt").read_text() == "Persuasion"
    assert "emma.txt: 20 characters" in done.stderr
    assert target.read_text() == "not a book" and not (tmp_path / "out" / "emma.txt").is_symlink()
