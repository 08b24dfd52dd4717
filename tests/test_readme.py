"""The README's example output is what its command prints (docs/readme_check.py).

The fast test runs the example's command on the tiny model and checks that every line has the shown line's
form (numbers aside); the slow one (``--run-slow``: the default model reads 8,192 tokens) runs the check itself.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from support import docs_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def readme_check():
    return docs_script("readme_check.py")


def form(line: str) -> str:
    """A line with its numbers as ``N``."""
    return re.sub(r"\d[\d,.]*", "N", line)


def test_the_first_example_is_the_set_up_command(readme_check):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = readme_check.examples(text)[0]
    set_up = re.search(r"&& (kvcli ppl [^\n`]*)\n", text).group(1)
    assert first.command == set_up and len(first.shown) == 4


def test_the_first_examples_lines_have_the_form_the_cli_prints(readme_check, invoke, tiny_model_dir, books):
    first = readme_check.examples((ROOT / "README.md").read_text(encoding="utf-8"))[0]
    args = shlex.split(first.command)[1:]
    args[args.index("--max-tokens") + 1] = "64"
    args[args.index("--cache") + 1] = "32"
    result = invoke(*args, "--model", str(tiny_model_dir), "--block", "16")
    assert result.exit_code == 0
    printed = result.stdout.rstrip("\n").replace(str(tiny_model_dir), "smollm2-135m").split("\n")
    shown = [line.replace("block 256", "block 16") for line in first.shown]
    assert [form(readme_check.steady(line)) for line in printed] == [form(readme_check.steady(line)) for line in shown]


def test_volatile_figures_are_masked_and_the_rest_compared(readme_check):
    shown = ["perplexity 19.288  (nll 2.9595 nats/token)", "KV cache 45.0 MiB · peak memory 1,217.4 MiB",
             "430.1 s · 19 tokens/s on cpu (float32)"]
    printed = ["perplexity 19.288  (nll 2.9595 nats/token)", "KV cache 45.0 MiB · peak memory 990.0 MiB",
               "22.0 s · 372 tokens/s on cpu (float32)"]
    assert readme_check.drift(shown, printed) == []
    assert readme_check.drift(shown, ["perplexity 21.512  (nll 2.9595 nats/token)", *printed[1:]])
    assert readme_check.drift(shown, printed[:2])


@pytest.mark.slow
def test_the_readme_examples_print_what_they_show(readme_check, books):
    assert readme_check.check(ROOT / "README.md", update=False) == 0
