"""The public API: every name of ``kvcli.__all__`` imports from the package root, and the README's "From Python"
example runs as shown and prints what the README says it prints.

The example loads the default model and reads 8,192 tokens (minutes on a 2-core CPU), so the test runs it on the
tiny model of the fixtures, the model name being the one thing it changes; the figures then differ, the form of
every printed line and the error line do not.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import kvcli

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_CALL = 'load_model("smollm2-135m"'


def readme_section(heading: str) -> str:
    """The README's text from ``heading`` to the next second-level heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def fenced(section: str, language: str) -> list[str]:
    """The bodies of the ``language`` code blocks of ``section``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.DOTALL | re.MULTILINE)


def form(line: str) -> str:
    """A line with its numbers as ``N`` (what a different model changes)."""
    return re.sub(r"\d[\d,.]*", "N", line)


def test_every_public_name_imports_from_the_root():
    assert set(kvcli.__all__) == set(kvcli.PUBLIC) | {"__version__"}
    for name in kvcli.__all__:
        namespace: dict[str, object] = {}
        exec(f"from kvcli import {name}", namespace)  # the statement a user writes
        assert namespace[name] is getattr(kvcli, name)
    for name, module in kvcli.PUBLIC.items():
        assert getattr(kvcli, name) is getattr(importlib.import_module(module), name), name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        kvcli.Engin  # noqa: B018


def test_the_readme_example_uses_only_the_public_names():
    code = fenced(readme_section("From Python"), "python")[0]
    imports = re.findall(r"^(?:from|import) .*$", code, flags=re.MULTILINE)
    assert imports and all(line.startswith("from kvcli import ") for line in imports), imports
    for line in imports:
        names = {name.strip() for name in line.removeprefix("from kvcli import ").split(",")}
        assert names <= set(kvcli.__all__), names


def test_the_readme_example_runs_as_shown_and_prints_the_lines_shown(tiny_model_dir, books, monkeypatch, capsys):
    section = readme_section("From Python")
    code, shown = fenced(section, "python")[0], fenced(section, "text")[0].rstrip("\n").split("\n")
    assert code.count(DEFAULT_MODEL_CALL) == 1
    monkeypatch.chdir(ROOT)  # the example's book path is relative to the checkout, as the README's commands are
    exec(compile(code.replace(DEFAULT_MODEL_CALL, f'load_model("{tiny_model_dir}"'), "README.md", "exec"),
         {"__name__": "readme_example"})
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    assert [form(line) for line in printed] == [form(line) for line in shown]
    assert "over 8,192 tokens" in printed[0]
    assert printed[1] == shown[1]  # the error does not depend on the model
