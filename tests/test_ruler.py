"""kvcli ruler: RULER's synthetic tasks built from a book, graded strictly, each trial what `kvcli ask` answers."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from kvcli.cli.ruler import TimeLeft
from kvcli.eval.ruler import TASKS, Book, make_sample, recall

SYLLABLES = ("ba", "ko", "mi", "ter", "su", "lan", "do", "vi", "ne", "rok", "pa", "lu", "sen", "ga", "fo")


def book_text(sentences: int = 600) -> str:
    """A book of made-up words (about 3,000 distinct ones, enough for cwe), in sentences of eight words."""
    words = ["".join(parts) for parts in itertools.product(SYLLABLES, repeat=3)]
    rng = random.Random(7)
    return " ".join(" ".join(rng.choice(words) for _ in range(8)).capitalize() + "." for _ in range(sentences))


@pytest.fixture()
def ruler_book(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(book_text(), encoding="utf-8")
    return path


def tiny(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--quiet"]


@pytest.mark.parametrize(("answer", "outputs", "score"), [
    ("The special magic numbers are 1234567 and 7654321.", ["1234567", "7654321"], 1.0),
    ("The special magic numbers are 1234567 and 7654322.", ["1234567", "7654321"], 0.5),
    ("The special magic number is 60494.", ["6049"], 0.0),  # a longer number holds the value, never answers it
    ("It is 1,234,567.", ["1234567"], 1.0),  # digits grouped as people write them
    ("1. Apple 2. pear", ["apple", "pear", "plum"], 2 / 3),  # case aside, as RULER lowercases
    ("apples and pears", ["apple", "pear"], 0.0),  # a word inside a longer word is not that word
    ("they are: ABCDE, FGHIJ", ["ABCDE", "FGHIJ"], 1.0),
    ("the key is red-fox-hole", ["red-fox"], 0.0),  # nor a hyphenated key inside a longer one
    ("uuid 3f2a6c1e-1b2c-4d5e-8f90-0123456789ab.", ["3f2a6c1e-1b2c-4d5e-8f90-0123456789ab"], 1.0),
])
def test_the_grader_scores_recall_of_whole_values(answer, outputs, score):
    assert recall(answer, outputs) == pytest.approx(score)


@pytest.mark.parametrize("name", list(TASKS))
def test_a_sample_holds_its_needles_fills_its_length_and_is_drawn_from_its_seed(smol_tokenizer, name):
    from kvcli.reading.prompts import build_prompt, encode, question_instruction

    book = Book(book_text())
    task = TASKS[name]
    sample = make_sample(smol_tokenizer, book, name, 1500, 1)
    assert sample == make_sample(smol_tokenizer, book, name, 1500, 1)
    assert sample.outputs != make_sample(smol_tokenizer, book, name, 1500, 1, seed=1).outputs
    parts = build_prompt(smol_tokenizer, question_instruction(sample.question, sample.answer_prefix))
    assert sample.doc == encode(smol_tokenizer, sample.document)
    assert sample.tokens == len(parts.prefix) + len(sample.doc) + len(parts.suffix) + task.reserve
    # the haystack grows by whole units: a word of the book, a list entry, a noise paragraph, a distractor line
    slack = {"repeat": 40, "needle": 80}.get(task.haystack, 40 if task.kind == "vt" else 10)
    assert 1500 - slack < sample.tokens <= 1500
    if task.kind == "niah":
        assert len(sample.outputs) == task.values * task.queries
        for value in sample.outputs:
            assert sample.document.count(f"is: {value}.") == 1
        assert sample.answer_prefix.endswith(" is" if len(sample.outputs) == 1 else " are")
    elif task.kind == "vt":
        assert len(sample.outputs) == 5 and all(f"VAR {var} = " in sample.document for var in sample.outputs)
    elif task.kind == "cwe":
        listed = sample.document.split("\n")[-1]
        counts = {word: listed.split().count(word) for word in sample.outputs}
        assert len(counts) == 10 and set(counts.values()) == {6}  # RULER's repeats below 4,096 tokens
    else:
        words = sample.document.split()
        top = sorted(set(words) - {"..."}, key=words.count, reverse=True)[:3]
        assert top == sample.outputs


def test_the_command_prints_one_score_per_cell_and_resumes(invoke, tiny_model_dir, ruler_book, tmp_path):
    rows = tmp_path / "rows.jsonl"
    common = [str(ruler_book), "--tasks", "niah_single_1,niah_single_2", "--lengths", "400", "--methods", "full,snapkv",
              "--samples", "2", "--cache", "64", "--block", "64", "-n", "4", *tiny(tiny_model_dir)]
    result = invoke("ruler", *common, "--json", "--rows", str(rows))
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    cells = [(row["task"], row["length"], row["method"]) for row in data["scores"]]
    assert cells == [("niah_single_1", 400, "full"), ("niah_single_1", 400, "snapkv"), ("niah_single_2", 400, "full"),
                     ("niah_single_2", 400, "snapkv"), ("average", 400, "full"), ("average", 400, "snapkv")]
    assert all(row["samples"] == (4 if row["task"] == "average" else 2) for row in data["scores"])
    assert all(row["ci95"][0] <= row["score"] <= row["ci95"][1] for row in data["scores"])
    assert len(data["trials"]) == 8 and all(t["one_shot"] for t in data["trials"])
    assert all(t["peak_memory_bytes"] > 0 for t in data["trials"])  # each trial's own peak, model included
    assert len(rows.read_text().splitlines()) == 8
    again = invoke("ruler", *common, "--json", "--rows", str(rows), "--resume")
    assert again.exit_code == 0 and json.loads(again.stdout)["trials"] == data["trials"]
    assert all("params" in json.loads(line) for line in rows.read_text().splitlines())
    older = tmp_path / "older.jsonl"  # rows written before trials recorded their peak memory still resume
    older.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "peak_memory_bytes"}) + "\n"
                             for line in rows.read_text().splitlines()))
    resumed = invoke("ruler", *common, "--json", "--rows", str(older), "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert [t["answer"] for t in json.loads(resumed.stdout)["trials"]] == [t["answer"] for t in data["trials"]]
    assert len(older.read_text().splitlines()) == 8  # nothing read again
    other = invoke("ruler", *common, "-o", "snapkv.window=4", "--rows", str(rows), "--resume")
    assert other.exit_code != 0 and "is a trial of another run (its params" in other.stderr
    text = invoke("ruler", *common)
    assert text.exit_code == 0 and len(text.stdout.strip().splitlines()) == 2 + 6
    loud = invoke("ruler", *[arg for arg in common if arg != "--quiet"], "--rows", str(rows), "--resume")
    progress = [line for line in loud.stderr.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{done}/8" for done in range(1, 9)]
    assert all(line.endswith(" left)") for line in progress[:-1]) and progress[-1].endswith(" s)")


def test_progress_says_the_time_left_from_each_lengths_trials_so_far():
    left = TimeLeft([4096, 16384])  # two trials a length
    assert left.after(4096, 60.0, 4) == "; about 9 min left"  # 60 s more at 4k, 2 x 240 s at 16k (four times as long)
    assert left.after(4096, 60.0, 4) == "; about 8 min left"
    assert left.after(16384, 120.0, 4) == "; about 2 min left"  # once timed, a length's own mean
    assert left.after(16384, 120.0, 4) == ""  # the last trial
    assert TimeLeft([1000]).after(1000, 60.0, 100) == "; about 1 h 39 min left"
    assert TimeLeft([10]).after(10, 1.0, 3) == "; under a minute left"


@pytest.mark.parametrize("arguments", [["--tasks", "niah_single_9"], ["--methods", "nope"], ["--samples", "0"],
                                       ["--lengths", "4x"], ["--resume"]])
def test_bad_options_are_one_line_before_any_model(invoke, ruler_book, arguments):
    result = invoke("ruler", str(ruler_book), *arguments, "--model", "/nonexistent")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1


# Read in one shot / streamed past the tiny model's 512 context; with ask's frame and without (--no-frame).
@pytest.mark.parametrize(("length", "frame"), [(400, []), (900, []), (400, ["--no-frame"])])
def test_a_ruler_trial_answers_what_ask_answers_on_its_text(invoke, tiny_model_dir, smol_tokenizer, ruler_book,
                                                           tmp_path, length, frame):
    common = [*tiny(tiny_model_dir), "--cache", "48", "--block", "64", "--max-new-tokens", "24", *frame]  # can loop
    data = json.loads(invoke("ruler", str(ruler_book), "--tasks", "niah_single_2", "--methods", "snapkv",
                             "--lengths", str(length), "--samples", "1", "--json", *common).stdout)
    (trial,) = data["trials"]
    sample = make_sample(smol_tokenizer, Book(ruler_book.read_text()), "niah_single_2", length, 0)
    assert sample.outputs == trial["outputs"]
    document = tmp_path / "document.txt"
    document.write_text(sample.document, encoding="utf-8")
    asked = json.loads(invoke("ask", str(document), sample.question, "--answer-prefix", sample.answer_prefix,
                              "--method", "snapkv", *common, "--json").stdout)
    assert asked["answer"].startswith(sample.answer_prefix)
    assert asked["answer"][len(sample.answer_prefix):].strip() == trial["answer"]
    assert (asked["prompt_tokens"], asked["one_shot"]) == (trial["prompt_tokens"], trial["one_shot"])
    assert trial["one_shot"] == (length < 512)
    assert ("Read the text above" in data["frame"]) == (not frame)


@pytest.mark.parametrize("recall", ["0", "32"])
def test_a_read_once_trial_answers_what_ask_answers_from_the_saved_read(invoke, tiny_model_dir, smol_tokenizer,
                                                                      ruler_book, tmp_path, recall):
    common = [*tiny(tiny_model_dir), "--cache", "48", "--block", "64", "--max-new-tokens", "24"]
    result = invoke("ruler", str(ruler_book), "--tasks", "niah_single_2", "--methods", "snapkv", "--lengths", "700",
                    "--samples", "1", "--read-once", "--recall", recall, "--json", *common)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    (trial,) = data["trials"]
    assert data["saved"] == int(recall) and not trial["one_shot"]
    sample = make_sample(smol_tokenizer, Book(ruler_book.read_text()), "niah_single_2", 700, 0)
    document, saved = tmp_path / "document.txt", tmp_path / "document.kvc"
    document.write_text(sample.document, encoding="utf-8")
    made = invoke("read", str(document), "--out", str(saved), "--method", "snapkv", *common[:-2])
    assert made.exit_code == 0, made.stderr
    asked = json.loads(invoke("ask", str(saved), sample.question, "--answer-prefix", sample.answer_prefix,
                              "--recall", recall, *tiny(tiny_model_dir), "--max-new-tokens", "24", "--json").stdout)
    (row,) = asked["answers"]
    assert row["answer"][len(sample.answer_prefix):].strip() == trial["answer"]


@pytest.mark.parametrize(("arguments", "says"), [(["--recall", "8"], "--recall goes with --read-once"),
                                                 (["--read-once", "--recap", "64"], "--recap do not apply"),
                                                 (["--read-once", "--recall", "-1"], "--recall must be")])
def test_read_once_options_that_do_not_fit_are_one_line(invoke, ruler_book, arguments, says):
    result = invoke("ruler", str(ruler_book), *arguments, "--model", "/nonexistent")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1 and says in result.stderr


def test_a_ratio_keeps_what_kvpress_keeps_of_the_context_and_the_question_whole():
    from kvcli.eval.ruler import kept_tokens

    # kvpress 0.5.5's compute_n_kept: max(1, int(k_len * (1 - compression_ratio))), truncated as floats truncate
    assert [kept_tokens(1000, r) for r in (0.5, 0.75, 0.875, 0.9)] == [500, 250, 125, 99]
    assert kept_tokens(3, 0.875) == 1


def test_ratios_give_each_trial_kvpress_budget_and_resume_only_their_own_rows(invoke, tiny_model_dir, smol_tokenizer,
                                                                            ruler_book, tmp_path):
    from kvcli.reading.prompts import build_prompt, question_instruction

    rows = tmp_path / "rows.jsonl"
    common = [str(ruler_book), "--tasks", "niah_single_1", "--lengths", "400", "--methods", "full,snapkv",
              "--samples", "2", "--block", "64", "-n", "4", "--recap", "0", *tiny(tiny_model_dir)]  # one forward
    result = invoke("ruler", *common, "--ratios", "0.5,0.75", "--json", "--rows", str(rows))
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["cache"], data["ratios"]) == (None, [0.5, 0.75])
    book = Book(ruler_book.read_text())
    for trial in data["trials"]:
        sample = make_sample(smol_tokenizer, book, "niah_single_1", 400, trial["index"])
        parts = build_prompt(smol_tokenizer, question_instruction(sample.question, sample.answer_prefix))
        context = len(parts.prefix) + len(sample.doc)  # what kvpress compresses; the question follows it whole
        assert trial["cache"] == int(context * (1 - trial["ratio"])) + len(parts.suffix)
        assert trial["one_shot"] and trial["prompt_tokens"] == context + len(parts.suffix)
        if trial["method"] == "snapkv":  # the read keeps the budget; the answer's 4 tokens join it as written
            assert trial["cache"] <= trial["max_cache_tokens"] <= trial["cache"] + 4
    cells = [(row["task"], row["ratio"], row["method"]) for row in data["scores"]]
    assert cells == [("niah_single_1", 0.5, "full"), ("niah_single_1", 0.5, "snapkv"), ("niah_single_1", 0.75, "full"),
                     ("niah_single_1", 0.75, "snapkv"), ("average", 0.5, "full"), ("average", 0.5, "snapkv"),
                     ("average", 0.75, "full"), ("average", 0.75, "snapkv")]
    assert [json.loads(line)["ratio"] for line in rows.read_text().splitlines()] == [0.5, 0.5, 0.75, 0.75] * 2
    # a resume takes each ratio's own rows: a new ratio is run, never read from another ratio's rows
    loud = [arg for arg in common if arg != "--quiet"]  # the note on what was taken goes to stderr
    again = invoke("ruler", *loud, "--ratios", "0.75,0.875", "--json", "--rows", str(rows), "--resume")
    assert again.exit_code == 0, again.stderr
    trials = json.loads(again.stdout)["trials"]
    assert [t for t in trials if t["ratio"] == 0.75] == [t for t in data["trials"] if t["ratio"] == 0.75]
    assert all(t["cache"] < min(d["cache"] for d in data["trials"] if d["ratio"] == 0.75)
               for t in trials if t["ratio"] == 0.875)
    assert len(rows.read_text().splitlines()) == 8 + 4
    assert "took 4 of 8 trials" in again.stderr  # 0.75's rows only: the file's 0.5 rows are not this grid's
    # nor are they a fixed --cache run's rows
    cached = invoke("ruler", *common, "--cache", "64", "--rows", str(rows), "--resume")
    assert cached.exit_code == 1 and "its cache is None, this run's 64" in cached.stderr
    assert len(cached.stderr.strip().splitlines()) == 1
    text = invoke("ruler", *common, "--ratios", "0.5", "--methods", "snapkv")
    assert text.exit_code == 0, text.stderr
    assert "ratio" in text.stdout.splitlines()[0] and "0.5" in text.stdout.splitlines()[2]


@pytest.mark.parametrize(("arguments", "message"), [
    (["--ratios", "0.5", "--cache", "512"], "give one of them"),
    (["--ratios", "1"], "less than 1"),
    (["--ratios", "0"], "greater than 0"),
    (["--ratios", "0.5,x"], "--ratios"),
    (["--ratios", "0.5", "--no-one-shot"], "give --cache"),
])
def test_bad_ratios_are_one_line_before_any_model(invoke, ruler_book, arguments, message):
    result = invoke("ruler", str(ruler_book), *arguments, "--model", "/nonexistent")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


@pytest.mark.parametrize(("arguments", "message"), [
    (["--lengths", "900", "--ratios", "0.5"], "a streamed read needs a fixed --cache"),  # past the 512 context
    (["--lengths", "400", "--ratios", "0.875", "--methods", "streamingllm", "-o", "streamingllm.sinks=200"],
     "choose a longer length or a lower ratio"),
])
def test_a_ratio_refuses_a_streamed_prompt_and_a_budget_too_small_in_one_line(invoke, tiny_model_dir, ruler_book,
                                                                               arguments, message):
    result = invoke("ruler", str(ruler_book), "--tasks", "niah_single_1", "--samples", "1", "-n", "4", *arguments,
                    *tiny(tiny_model_dir))
    assert result.exit_code == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_full_reads_a_sample_once_for_every_ratio(invoke, tiny_model_dir, ruler_book, monkeypatch):
    """``full`` ignores the budget, so its read at one ratio is its read at every other: one read per sample."""
    from kvcli.eval import ruler

    reads = []
    real = ruler.Reading.trial
    monkeypatch.setattr(ruler.Reading, "trial", lambda self, *args: reads.append(args[2]) or real(self, *args))
    result = invoke("ruler", str(ruler_book), "--tasks", "niah_single_1", "--lengths", "400", "--methods",
                    "full,snapkv", "--samples", "1", "--block", "64", "-n", "4", *tiny(tiny_model_dir),
                    "--ratios", "0.5,0.75,0.875", "--json")
    assert result.exit_code == 0, result.stderr
    assert reads == ["full", "snapkv", "snapkv", "snapkv"]
    trials = json.loads(result.stdout)["trials"]
    full = [trial for trial in trials if trial["method"] == "full"]
    assert [trial["ratio"] for trial in full] == [0.5, 0.75, 0.875]
    assert len({trial["answer"] for trial in full}) == 1
    assert [t["cache"] for t in full] == [t["cache"] for t in trials if t["method"] == "snapkv"]


def test_export_writes_the_samples_a_run_reads_as_kvpress_takes_them(invoke, tiny_model_dir, smol_tokenizer,
                                                                    ruler_book, tmp_path):
    import hashlib

    from kvcli.eval.ruler import template_digest
    from kvcli.reading.prompts import build_prompt, question_instruction

    export = tmp_path / "samples.jsonl"
    # a run's command line with --export added: the reading settings (methods, ratios) change no sample
    arguments = [str(ruler_book), "--tasks", "niah_single_1,niah_multikey_2", "--lengths", "400,450", "--samples",
                 "2", "--methods", "snapkv", "--ratios", "0.5", "-n", "4", *tiny(tiny_model_dir), "--export",
                 str(export)]
    for _ in range(2):  # a second export replaces the file, it does not add to it
        result = invoke("ruler", *arguments)
        assert result.exit_code == 0, result.stderr
        assert result.stdout == ""
    records = [json.loads(line) for line in export.read_text(encoding="utf-8").splitlines()]
    assert [(r["task"], r["length"], r["index"]) for r in records] == [
        (task, length, index) for length in (400, 450) for task in ("niah_single_1", "niah_multikey_2")
        for index in (0, 1)]
    book = Book(ruler_book.read_text())
    digest = hashlib.sha256(ruler_book.read_text().encode("utf-8")).hexdigest()
    for record in records:
        sample = make_sample(smol_tokenizer, book, record["task"], record["length"], record["index"], seed=0)
        parts = build_prompt(smol_tokenizer, question_instruction(sample.question, sample.answer_prefix))
        assert record == {
            "task": sample.task, "length": sample.length, "index": sample.index, "seed": 0,
            "context": sample.document, "question": "\n\n" + sample.question,
            "answer_prefix": sample.answer_prefix, "outputs": sample.outputs, "answer_tokens": 4,
            "tokens": sample.tokens, "context_tokens": len(parts.prefix) + len(sample.doc),
            "question_tokens": len(parts.suffix), "book_sha256": digest, "model": str(tiny_model_dir),
            "chat_template_sha256": template_digest(smol_tokenizer)}
        assert record["chat_template_sha256"] is not None  # SmolLM2's tokenizer has a chat template


@pytest.mark.parametrize(("arguments", "code", "message"), [
    (["--export", "/nonexistent-folder/samples.jsonl"], 1, "no such folder"),
    (["--export", "{tmp}", "--json"], 2, "runs no trial"),
    (["--export", "{book}"], 2, "never replaces an input"),
])
def test_a_bad_export_is_one_line_before_any_model(invoke, ruler_book, tmp_path, arguments, code, message):
    arguments = [a.format(tmp=tmp_path / "samples.jsonl", book=ruler_book) for a in arguments]
    result = invoke("ruler", str(ruler_book), *arguments, "--model", "/nonexistent")
    assert result.exit_code == code, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert ruler_book.read_text() == book_text()


def test_plot_draws_the_scores_against_the_ratio_or_per_task(invoke, tiny_model_dir, ruler_book, tmp_path):
    common = [str(ruler_book), "--tasks", "niah_single_1", "--lengths", "400", "--methods", "full,snapkv",
              "--samples", "1", "--block", "64", "-n", "2", *tiny(tiny_model_dir)]
    for budget, name in ((["--ratios", "0.5,0.75"], "ratios.png"), (["--cache", "64"], "tasks.png")):
        result = invoke("ruler", *common, *budget, "--plot", str(tmp_path / name))
        assert result.exit_code == 0, result.stderr
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    refused = invoke("ruler", *common, "--plot", str(ruler_book))  # never over the book it reads
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1
    target = tmp_path / "kept.txt"
    target.write_text("not a plot")
    (tmp_path / "link.png").symlink_to(target)  # a link at --plot is replaced, never written through
    assert invoke("ruler", *common, "--cache", "64", "--plot", str(tmp_path / "link.png")).exit_code == 0
    assert target.read_text() == "not a plot" and not (tmp_path / "link.png").is_symlink()


def test_the_table_script_puts_one_method_at_two_commits_side_by_side(tmp_path):
    """docs/results/ruler_table.py joins rows files on their samples; ``FILE=LABEL`` names a file's columns, so the
    same method before and after a change are two columns, in the order the files were given."""
    import subprocess
    import sys

    def rows(name: str, scores: list[float]) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"task": "vt", "length": 4096, "index": i, "method": "snapkv", "ratio": 0.5,
                                            "score": s}) + "\n" for i, s in enumerate(scores)))
        return str(path)

    script = Path(__file__).parent.parent / "docs" / "results" / "ruler_table.py"
    out = subprocess.run([sys.executable, str(script), rows("old.jsonl", [0.0, 1.0]) + "=before",
                          rows("new.jsonl", [1.0, 1.0]) + "=after"], capture_output=True, text=True, check=True).stdout
    assert "| task | snapkv 0.5 before | snapkv 0.5 after |" in out
    assert "| vt | 50 | 100 |" in out


def test_the_table_script_keeps_one_length_and_summarises_a_column_a_line(tmp_path):
    """``--length`` keeps one length's rows of a file that holds two; ``--summary`` prints a column's average, its
    interval and its trials on one line."""
    import subprocess
    import sys

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"task": "vt", "length": length, "index": i, "method": "treekv", "ratio": None,
                                        "cache": 1024, "score": score}) + "\n"
                            for length, scores in ((4096, [1.0, 1.0]), (16384, [0.0, 1.0]))
                            for i, score in enumerate(scores)))
    script = Path(__file__).parent.parent / "docs" / "results" / "ruler_table.py"

    def table(*options: str) -> str:
        return subprocess.run([sys.executable, str(script), str(path), *options], capture_output=True, text=True,
                              check=True).stdout

    assert "| vt | 50 |" in table("--length", "16k") and "| vt | 100 |" in table("--length", "4096")
    assert "| vt | 75 |" in table()  # both lengths
    assert "| treekv cache 1024 | **50.0** (" in table("--length", "16k", "--summary")
    assert "| 2 |" in table("--length", "16k", "--summary")
    better = tmp_path / "better.jsonl"  # the same samples at another cache: one sample up, none down
    better.write_text(path.read_text().replace('"cache": 1024', '"cache": 2048')
                      .replace('"score": 0.0', '"score": 1.0'))
    paired = table(str(better), "--length", "16k", "--summary")
    assert "| treekv cache 1024 | **50.0** (" in paired and "| 2 |  |" in paired
    assert "| treekv cache 2048 | **100.0** (" in paired and "| 2 | 1 / 0 |" in paired
    other = tmp_path / "other.jsonl"  # a column of another length shares no sample with the first: one line
    other.write_text(path.read_text().replace('"length": 4096', '"length": 8192').replace('"length": 16384',
                                                                                          '"length": 32768'))
    apart = subprocess.run([sys.executable, str(script), str(path), f"{other}=other"], capture_output=True, text=True)
    assert apart.returncode != 0 and apart.stderr.strip().splitlines() == [
        "ruler_table: no sample is read by every column (columns of other lengths? give --length)"]


def test_the_table_script_sets_each_method_at_one_length_against_another(tmp_path):
    """``--length 16k --against 4k`` prints a line a column: its average at 4k, at 16k and their ratio (#53's
    streamed goal), each length over the samples every column of that length read; a column with one length (full
    attention past the window) gets no ratio, and ``--against`` without ``--length`` is one line."""
    import subprocess
    import sys

    def rows(method: str, by_length: dict[int, list[float]]) -> str:
        return "".join(json.dumps({"task": "vt", "length": length, "index": i, "method": method, "ratio": None,
                                   "cache": 1024, "score": score}) + "\n"
                       for length, scores in by_length.items() for i, score in enumerate(scores))

    path = tmp_path / "rows.jsonl"
    path.write_text(rows("treekv", {4096: [1.0, 1.0, 0.0, 1.0], 16384: [1.0, 0.0, 0.5, 1.0]})
                    + rows("full", {4096: [1.0, 0.0, 0.0, 1.0]}))
    script = Path(__file__).parent.parent / "docs" / "results" / "ruler_table.py"
    out = subprocess.run([sys.executable, str(script), str(path), "--length", "16k", "--against", "4k"],
                         capture_output=True, text=True, check=True).stdout
    assert "| column | 4k (95% CI) | 16k (95% CI) | 16k / 4k |" in out
    assert re.search(r"\| treekv cache 1024 \| \*\*75\.0\*\* \(\d+-\d+\) \| \*\*62\.5\*\* \(\d+-\d+\) \| 83 % \|", out)
    assert re.search(r"\| full \| \*\*50\.0\*\* \(\d+-\d+\) \|  \|  \|", out)
    alone = subprocess.run([sys.executable, str(script), str(path), "--against", "4k"], capture_output=True, text=True)
    assert alone.returncode != 0 and alone.stderr.strip().splitlines() == [
        "ruler_table: --against needs --length (the length it is set against)"]


def test_the_table_script_prints_what_the_trials_cost_a_line_a_file_and_length(tmp_path):
    """``--costs`` prints, per file and length, the trials, the first trial's peak memory and the largest, the median
    seconds and the most tokens cached, so the memory and time docs/results.md quotes come from a command."""
    import subprocess
    import sys

    path = tmp_path / "rows.jsonl"
    trials = [(4096, 2**30, 10.0, 1024), (4096, 3 * 2**30, 30.0, 1030), (4096, 2 * 2**30, 20.0, 1024),
              (16384, 2**31, 50.0, 1024)]
    path.write_text("".join(json.dumps({"task": "vt", "length": n, "index": i, "method": "treekv", "ratio": None,
                                        "cache": 1024, "score": 1.0, "peak_memory_bytes": peak, "seconds": s,
                                        "max_cache_tokens": kept}) + "\n"
                            for i, (n, peak, s, kept) in enumerate(trials)))
    script = Path(__file__).parent.parent / "docs" / "results" / "ruler_table.py"
    out = subprocess.run([sys.executable, str(script), f"{path}=label", "--costs"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[2:] == ["| rows.jsonl | 4,096 | 3 | 1.00 | 3.00 | 20 | 1,030 |",
                       "| rows.jsonl | 16,384 | 1 | 2.00 | 2.00 | 50 | 1,024 |"]
    one = subprocess.run([sys.executable, str(script), str(path), "--costs", "--length", "16k"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert one[2:] == ["| rows.jsonl | 16,384 | 1 | 2.00 | 2.00 | 50 | 1,024 |"]
    kvpress = tmp_path / "kvpress.jsonl"  # kvpress_ruler.py's rows: its own names for the peak and the kept tokens
    kvpress.write_text(json.dumps({"task": "vt", "length": 8192, "index": 0, "method": "kvpress:SnapKVPress",
                                   "ratio": 0.5, "score": 0.0, "peak_rss_bytes": 3 * 2**29, "seconds": 12.4,
                                   "kept_tokens": 4012}) + "\n")
    theirs = subprocess.run([sys.executable, str(script), str(kvpress), "--costs"], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    assert theirs[2:] == ["| kvpress.jsonl | 8,192 | 1 | 1.50 | 1.50 | 12 | 4,012 |"]
