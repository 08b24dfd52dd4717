"""Bad inputs a new user meets (the review battery's cases): an output never writes over an input, rows know
what made them, an empty document does not stop a corpus, and every mistake is one line, never a traceback."""

from __future__ import annotations

import os

from test_corpora import corpus, one_line_error

# --------------------------------------------------------------------------- outputs never land on inputs


def _refused(invoke, args: list, *inputs) -> str:
    """Run ``args``, check it is refused with one usage line before anything is written, and that every one of
    ``inputs`` is byte for byte what it was; return the line."""
    before = {path: path.read_bytes() for path in inputs}
    line = one_line_error(invoke(*args, "--quiet"), 2)
    for path, data in before.items():
        assert path.read_bytes() == data, path
    return line


def test_an_output_equal_to_the_source_is_refused_and_the_source_is_intact(invoke, tiny_model_dir, book):
    model = ["--model", tiny_model_dir]
    for args in (["ppl", book, "-n", "64", "--jsonl", book], ["ppl", book, "-n", "64", "--save-logits", book],
                 ["calibrate", book, "--samples", "2", "--tokens", "128", "--q", "8", "--out", book]):
        line = _refused(invoke, [*args, *model], book)
        assert f"{args[-2]} {book} is the source {book}" in line and "never replaces an input" in line


def test_an_output_inside_a_corpus_folder_is_refused(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    doc = folder / "doc2.txt"
    line = _refused(invoke, ["ppl", folder, "--rows", doc, "--json", "--model", tiny_model_dir], doc)
    assert f"--rows {doc} lies inside the source {folder}" in line
    # Not only over a document: a new file in the folder would be read as one by the next run.
    line = _refused(invoke, ["ppl", folder, "--rows", folder / "rows.jsonl", "--model", tiny_model_dir])
    assert "lies inside the source" in line and not (folder / "rows.jsonl").exists()


def test_a_hard_link_or_a_symlink_to_the_source_is_the_source(invoke, tiny_model_dir, book, tmp_path):
    hard, soft = tmp_path / "hard.txt", tmp_path / "soft.txt"
    os.link(book, hard)
    soft.symlink_to(book)
    for output in (hard, soft):
        line = _refused(invoke, ["ppl", book, "--jsonl", output, "--model", tiny_model_dir], book)
        assert f"--jsonl {output} is the source {book} (the same file by another name)" in line
    line = _refused(invoke, ["ppl", soft, "--save-logits", book, "--model", tiny_model_dir], book)
    assert "the same file by another name" in line


def test_outputs_apart_from_the_model_the_reference_presets_and_each_other(invoke, tiny_model_dir, book, tmp_path,
                                                                          config_home):
    preset = tmp_path / "mine.toml"
    preset.write_text('method = "streamingllm"\ncache = 64\n')
    inside = tiny_model_dir / "rows.jsonl"
    cases = [
        (["ppl", book, "--jsonl", inside, "--model", tiny_model_dir], "lies inside the model"),
        (["adapt", "--data", book, "--tokens", "128", "--out", tiny_model_dir, "--model", tiny_model_dir],
         "is the model"),
        (["ppl", book, "--checkpoint", book.parent, "--model", tiny_model_dir], "holds the source"),
        (["ppl", book, "--kl-base", preset, "--save-logits", preset, "--model", tiny_model_dir], "is --kl-base"),
        (["ask", book, "Who?", "--each", "--rows", preset, "--preset", preset, "--model", tiny_model_dir],
         "is --preset"),
        (["ppl", book, "--jsonl", tmp_path / "a", "--rows", tmp_path / "a", "--model", tiny_model_dir],
         "are the same path"),
        (["bench", book, "--out", book.parent, "--model", tiny_model_dir], "holds the source"),
        (["analyze", book, "--out", book, "--model", tiny_model_dir], "is the source"),
    ]
    for args, message in cases:
        line = _refused(invoke, args, book, preset)
        assert message in line, (args, line)
    assert not inside.exists()


def test_devices_are_written_into_never_compared(invoke, tiny_model_dir, book):
    result = invoke("ppl", book, "-n", "32", "--jsonl", os.devnull, "--save-logits", os.devnull,
                    "--model", tiny_model_dir, "--quiet", "--json")
    assert result.exit_code == 0, result.stderr
