"""A plot is never overwritten: a second needle run writes needle-2.png beside the first's needle.png (issue 57)."""

from __future__ import annotations

import pytest

from kvcli.errors import KvcliError
from kvcli.eval.needle_plot import claim_unused


def test_the_first_free_name_is_claimed(tmp_path):
    target = tmp_path / "needle.png"
    assert claim_unused(target) == target and target.read_bytes() == b""
    target.write_bytes(b"first")
    assert claim_unused(target) == tmp_path / "needle-2.png"
    assert claim_unused(target) == tmp_path / "needle-3.png"  # the name claimed above is taken, even empty
    assert target.read_bytes() == b"first"


def test_an_unwritable_folder_is_one_line(tmp_path):
    with pytest.raises(KvcliError, match="cannot write"):
        claim_unused(tmp_path / "missing" / "needle.png")
