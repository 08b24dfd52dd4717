"""Bad inputs a new user meets (the review battery's cases): an output never writes over an input, rows know
what made them, an empty document does not stop a corpus, and every mistake is one line, never a traceback."""

from __future__ import annotations

import json
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


# --------------------------------------------------------------------------- rows know what made them

def _ppl(folder, model, *extra):
    return ["ppl", folder, "--model", model, "--cache", "48", "--block", "16", "--json", "--quiet", *extra]


def test_rows_resume_only_under_the_settings_that_made_them(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    rows = tmp_path / "rows.jsonl"
    assert invoke(*_ppl(folder, tiny_model_dir, "--rows", rows)).exit_code == 0
    run = json.loads(rows.read_text().splitlines()[0])["run"]
    assert run["command"] == "ppl" and run["method"] == "streamingllm" and run["budget"] == 48 and run["format"] == 1
    before = rows.read_bytes()
    cases = [(["--method", "full"], "its method is 'streamingllm', this run's 'full'"),
             (["--dtype", "bfloat16"], "its dtype is 'torch.float32', this run's 'torch.bfloat16'"),
             (["--block", "32"], "its block is 16, this run's 32"),
             (["--kv-bits", "8"], "its kv_bits is 16, this run's 8")]
    for extra, message in cases:
        line = one_line_error(invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume", *extra)))
        assert f"--rows {rows}: the row of {folder / 'doc0.txt'} was not made by this run ({message}" in line
        assert rows.read_bytes() == before  # nothing mixed in, nothing lost
    again = invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume"))
    assert again.exit_code == 0 and json.loads(again.stdout)["job"]["resumed"] == 3
    # A row written before rows recorded their run is not taken on trust.
    rows.write_text(json.dumps({k: v for k, v in json.loads(before.splitlines()[0]).items() if k != "run"}) + "\n")
    assert "it records no run" in one_line_error(invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume")))


def test_rows_of_another_question_or_command_are_refused(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path, count=2)
    rows = tmp_path / "rows.jsonl"
    ask = ["ask", folder, "What colour is the rabbit?", "--each", "--rows", rows, "-n", "2", "--cache", "64",
           "--model", tiny_model_dir, "--quiet"]
    assert invoke(*ask).exit_code == 0, rows.read_text()
    line = one_line_error(invoke(*[("Who is Alice?" if a == ask[2] else a) for a in ask], "--resume"))
    assert "its question is 'What colour is the rabbit?', this run's 'Who is Alice?'" in line
    line = one_line_error(invoke(*_ppl(folder, tiny_model_dir, "--rows", rows, "--resume")))
    assert "it is a row of kvcli ask, this run is ppl" in line
    summary = ["summarize", folder, "--each", "--rows", rows, "-n", "2", "--cache", "64", "--model", tiny_model_dir,
               "--quiet", "--resume"]
    assert "it is a row of kvcli ask, this run is summarize" in one_line_error(invoke(*summary))


def test_a_rows_file_or_bench_folder_in_use_refuses_a_second_run(invoke, book, tmp_path):
    import fcntl

    from kvcli.outputs import LOCK_FILE

    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    out = tmp_path / "bench"
    out.mkdir()
    with open(rows, "a") as held, open(out / LOCK_FILE, "a+") as other:  # another run holds both, as kvcli does
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for args in (["ppl", book, "--rows", rows], ["ask", book, "Who?", "--each", "--rows", rows],
                     ["needle", book, "--rows", rows, "--no-plots"]):
            line = one_line_error(invoke(*args, "--model", "/no/such/model", "--quiet"))  # refused before the model
            assert f"--rows {rows} is in use by another kvcli run" in line, args
        line = one_line_error(invoke("bench", book, "--out", out, "--model", "/no/such/model", "--quiet"))
        assert f"--out {out} is in use by another kvcli run" in line


# --------------------------------------------------------------------------- an empty document is skipped


def test_an_empty_document_is_skipped_with_a_row_and_the_corpus_finishes(invoke, tiny_model_dir, tmp_path):
    folder = corpus(tmp_path)
    (folder / "doc1.txt").write_text("")
    (folder / "doc2.txt").write_text("Alice")  # one token: nothing to score
    rows = tmp_path / "rows.jsonl"
    args = [a for a in _ppl(folder, tiny_model_dir, "--rows", rows) if a != "--quiet"]
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    assert f"{folder / 'doc1.txt'} is empty: skipped" in result.stderr
    assert f"{folder / 'doc2.txt'} has fewer than 2 tokens (nothing to score): skipped" in result.stderr
    data = json.loads(result.stdout)
    assert [row.get("skipped") for row in data["documents"]] == [None, "empty", "empty"]
    assert data["tokens"] == data["documents"][0]["tokens"] > 0
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [row.get("skipped") for row in written] == [None, "empty", "empty"]
    again = invoke(*args, "--resume")
    assert again.exit_code == 0 and json.loads(again.stdout)["job"]["resumed"] == 3
    assert json.loads(again.stdout)["ppl"] == data["ppl"]
    # ask --each prints the skipped row among the answers; one empty file alone is still an error.
    each = invoke("ask", folder, "Who?", "--each", "-n", "2", "--cache", "64", "--model", tiny_model_dir, "--quiet")
    assert each.exit_code == 0, each.stderr
    assert [json.loads(line).get("skipped") for line in each.stdout.splitlines()] == [None, "empty", None]
    assert "input is empty" in one_line_error(invoke(*_ppl(folder / "doc1.txt", tiny_model_dir)))
