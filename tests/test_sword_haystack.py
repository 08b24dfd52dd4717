"""docs/results/sword_haystack.py: a SWORD module's zlib blocks, in index order, as plain text."""

from __future__ import annotations

import struct
import zlib

from support import docs_script


def _script():
    return docs_script("results/sword_haystack.py")


def test_blocks_are_read_in_index_order_and_the_markup_dropped(tmp_path):
    """Two blocks written out of place order in the data file come back in the index's order; an empty index entry
    is skipped; OSIS paragraphs become lines, tags go, entities are decoded."""
    script = _script()
    first = zlib.compress(b'<div sID="a" type="x-p"/> Blessed &amp; <hi type="italic">happy</hi> '
                          b'<div eID="a" type="x-p"/>')
    second = zlib.compress(b"<title>Psalm 2</title> Why do the heathen rage?")
    (tmp_path / "ot.czz").write_bytes(second + first)
    entries = [(len(second), len(first), 0), (0, 0, 0), (0, len(second), 0)]
    (tmp_path / "ot.czs").write_bytes(b"".join(struct.pack("<III", *entry) for entry in entries))
    osis = b"".join(script.blocks(tmp_path, "ot")).decode()
    assert script.plain(osis) == "Blessed & happy\nPsalm 2 Why do the heathen rage?"
    assert script.blocks(tmp_path, "nt") == []  # a testament the module lacks
