"""summarize, ask, needle and presets as a user meets them: stdout holds only the result, pipes, presets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import TEXT

from kvcli.reading.prompts import ASK_FRAME

KEYS = {"prompt_tokens", "generated_tokens", "max_cache_tokens", "kv_cache_bytes", "peak_memory_bytes", "seconds",
        "model", "method", "cache"}


@pytest.fixture(autouse=True)
def _no_user_presets(config_home):
    """Every test here sees the built-in presets only."""


def tiny(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--quiet"]


@pytest.mark.parametrize("command", ["summarize", "ask", "needle", "presets"])
def test_help(invoke, command):
    result = invoke(command, "--help")
    assert result.exit_code == 0 and "Usage" in result.stdout


def test_every_commands_help_is_its_docstring_a_paragraph_a_line():
    # Typer's rich help keeps single line breaks; a docstring's would cut the help's sentences at the source's width.
    from kvcli.cli.app import app, one_line_paragraphs
    from kvcli.cli.cache import app as cache_app

    doc = "First line\n  goes on.\n\nSecond\nparagraph.\n"
    assert one_line_paragraphs(doc) == "First line goes on.\n\nSecond paragraph."
    for info in [*app.registered_commands, *cache_app.registered_commands]:
        assert info.help == one_line_paragraphs(info.callback.__doc__), info.callback.__name__
        assert all("\n" not in paragraph for paragraph in info.help.split("\n\n"))


def test_summarize_streams_exactly_the_summary_to_stdout(invoke, tiny_model_dir, book, smol_tokenizer):
    from kvcli.reading.prompts import TEMPLATES, build_prompt

    common = [str(book), *tiny(tiny_model_dir), "--method", "streamingllm", "--cache", "64", "--block", "32",
              "--max-new-tokens", "24", "--temperature", "1.0", "--seed", "3"]
    streamed = invoke("summarize", *common)
    assert streamed.exit_code == 0 and streamed.stderr == ""
    data = json.loads(invoke("summarize", *common, "--json").stdout)
    assert KEYS | {"summary"} <= set(data)
    assert streamed.stdout.endswith("\n") and streamed.stdout.strip() == data["summary"] != ""
    assert data["generated_tokens"] == 24 and data["max_cache_tokens"] <= 64 and not data["one_shot"]
    parts = build_prompt(smol_tokenizer, TEMPLATES["summary"])
    assert data["prompt_tokens"] == len(parts.prefix) + data["document_tokens"] + len(parts.suffix)


def test_statistics_go_to_stderr(invoke, tiny_model_dir, book):
    result = invoke("summarize", str(book), "--model", str(tiny_model_dir), "--method", "streamingllm", "--cache",
                    "64", "--max-new-tokens", "4")
    assert result.exit_code == 0
    assert "prompt tokens" in result.stderr and "max cache" in result.stderr and "prompt" not in result.stdout


@pytest.mark.parametrize("method", ["streamingllm", "treekv"])
def test_decoding_evicts_to_stay_within_the_cache(invoke, tiny_model_dir, tmp_path, method):
    from kvcli.methods import METHODS

    if method not in METHODS:
        pytest.skip(f"{method} is not registered yet")
    short = tmp_path / "short.txt"
    short.write_text("A very short note.")
    data = json.loads(invoke("summarize", str(short), *tiny(tiny_model_dir), "--method", method, "--cache", "56",
                             "--max-new-tokens", "40", "--json").stdout)
    assert data["one_shot"] and data["prompt_tokens"] < 56
    assert data["prompt_tokens"] + data["generated_tokens"] > 56  # only eviction while decoding keeps it at 56
    assert data["max_cache_tokens"] == 56


def test_snapkv_keeps_its_answer_as_its_paper_does(invoke, tiny_model_dir, tmp_path):
    """SnapKV compresses the prompt only: the cache grows by the generated tokens while writing, and by nothing
    else (the last token needs no forward)."""
    short = tmp_path / "short.txt"
    short.write_text("A very short note.")
    data = json.loads(invoke("summarize", str(short), *tiny(tiny_model_dir), "--method", "snapkv", "--cache", "56",
                             "--max-new-tokens", "40", "--json").stdout)
    assert data["one_shot"] and data["prompt_tokens"] < 56 and data["finish_reason"] == "length"
    assert data["max_cache_tokens"] == data["prompt_tokens"] + data["generated_tokens"] - 1


def test_ask_reads_stdin_and_answers_in_json(invoke, tiny_model_dir):
    result = invoke("ask", "-", "Who is tired?", *tiny(tiny_model_dir), "--method", "streamingllm", "--cache", "64",
                    "--block", "32", "--max-new-tokens", "5", "--answer-prefix", "It is", "--json", input=TEXT * 2)
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert KEYS | {"answer"} <= set(data) and "summary" not in data
    assert data["answer"].startswith("It is") and data["generated_tokens"] == 5
    assert data["document_tokens"] > 900 and not data["one_shot"]  # longer than the tiny model's context


def test_ask_without_its_frame_reads_the_question_as_written(invoke, tiny_model_dir, smol_tokenizer):
    """--no-frame: the prompt holds the bare question where ask's frame would have stood, so it is shorter by
    exactly the frame's tokens."""
    from kvcli.reading.prompts import ASK_FRAME, build_prompt, question_instruction

    common = ["ask", "-", "Who is tired?", *tiny(tiny_model_dir), "--method", "snapkv", "--cache", "64",
              "--max-new-tokens", "2", "--recap", "0", "--json"]  # no recap: the prompt is the text and question
    framed = json.loads(invoke(*common, input=TEXT[:400]).stdout)
    bare = json.loads(invoke(*common, "--no-frame", input=TEXT[:400]).stdout)
    suffix = build_prompt(smol_tokenizer, question_instruction("Who is tired?", frame=False)).suffix
    assert smol_tokenizer.decode(suffix).startswith("\n\nWho is tired?<|im_end|>")
    assert framed["prompt_tokens"] - bare["prompt_tokens"] == \
        len(build_prompt(smol_tokenizer, question_instruction("Who is tired?")).suffix) - len(suffix)
    assert ASK_FRAME.split("{")[0].strip() not in smol_tokenizer.decode(suffix)


def test_ask_recaps_a_streamed_document_before_the_question_unless_told_not_to(invoke, tiny_model_dir):
    common = ["ask", "-", "Who is tired?", *tiny(tiny_model_dir), "--method", "snapkv", "--cache", "64", "--block",
              "32", "--max-new-tokens", "2", "--json"]
    default = json.loads(invoke(*common, input=TEXT * 2).stdout)
    off = json.loads(invoke(*common, "--recap", "0", input=TEXT * 2).stdout)
    assert 0 < default["recap_tokens"] <= 512 and off["recap_tokens"] == 0
    assert default["document_tokens"] == off["document_tokens"]
    assert default["prompt_tokens"] > off["prompt_tokens"] + default["recap_tokens"]  # and the separator
    summary = json.loads(invoke("summarize", "-", *common[3:], input=TEXT * 2).stdout)
    assert summary["recap_tokens"] == 0  # a summary needs the whole text, not passages


def test_one_shot_switch(invoke, tiny_model_dir, tmp_path):
    half = tmp_path / "half.txt"
    half.write_text(TEXT[: len(TEXT) // 2])
    common = ["summarize", str(half), *tiny(tiny_model_dir), "--method", "streamingllm", "--cache", "64",
              "--max-new-tokens", "2", "--json"]
    assert json.loads(invoke(*common, "--one-shot").stdout)["one_shot"] is True
    assert json.loads(invoke(*common, "--no-one-shot").stdout)["one_shot"] is False
    assert json.loads(invoke(*common).stdout)["one_shot"] is True  # ~280 tokens fit the tiny model's 512


def test_a_closed_stdout_ends_quietly(tiny_model_dir, book):
    proc = subprocess.Popen([sys.executable, "-m", "kvcli", "summarize", str(book), *tiny(tiny_model_dir),
                             "--method", "streamingllm", "--cache", "64", "--max-new-tokens", "400", "--temperature",
                             "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, stderr
    assert "Traceback" not in stderr and "Error" not in stderr


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["summarize", "BOOK", "--method", "nosuch"], "unknown method", 2),
        (["summarize", "BOOK", "--prompt", "Say it.", "--template", "tldr"], "alternatives", 2),
        (["summarize", "BOOK", "--template", "nosuch"], "unknown --template", 2),
        (["ask", "BOOK", "Why?", "--preset", "nosuch"], "unknown preset", 2),
        (["needle", "BOOK", "--methods", "full,nosuch"], "unknown method", 2),
        (["ask", "BOOK", "Why?", "--recap", "5"], "--recap must be 0 (off) or at least 17", 2),
        (["needle", "BOOK", "--recap", "-1"], "--recap must be 0", 2),
        (["ask", "/no/such/book.txt", "Why?", "--method", "streamingllm"], "no such file", 1),
    ],
)
def test_errors_exit_with_one_line(invoke, args, message, code, book):
    args = [str(book) if a == "BOOK" else a for a in args]
    result = invoke(*args)
    assert result.exit_code == code, result.stderr
    assert result.stdout == "" and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_presets_listing(invoke, config_home):
    data = json.loads(invoke("presets", "--json").stdout)
    rows = {row["name"]: row for row in data}
    assert rows["smollm2-135m"]["kind"] == "model" and rows["treekv-1024"]["kind"] == "method"
    assert rows["pyramidkv-beta5"]["kind"] == "method"
    assert rows["pyramidkv-beta5"]["settings"]["options"] == {"beta": 5.0}
    assert all(row["path"].endswith(".toml") and row["source"] == "built-in" for row in data)
    text = invoke("presets").stdout
    assert "model presets:" in text and "method presets:" in text and "treekv-1024" in text


def test_presets_fill_defaults_and_explicit_options_win(invoke, tiny_model_dir, book, config_home):
    folder = config_home / "kvcli" / "presets"
    folder.mkdir(parents=True)
    (folder / "tiny.toml").write_text(f'model = "{tiny_model_dir}"\nstop = ["zzzz"]\n')
    (folder / "small-stream.toml").write_text('method = "streamingllm"\ncache = 40\nblock = 8\n'
                                              "[options]\nsinks = 2\n")
    listed = {row["name"]: row for row in json.loads(invoke("presets", "--json").stdout)}
    assert listed["tiny"]["source"] == "user" and listed["small-stream"]["kind"] == "method"
    common = ["summarize", str(book), "--preset", "tiny", "--preset", "small-stream", "--max-new-tokens", "2",
              "--json", "--quiet"]
    data = json.loads(invoke(*common).stdout)
    assert data["model"] == str(tiny_model_dir)
    assert (data["method"], data["cache"], data["block"], data["params"]["sinks"]) == ("streamingllm", 40, 8, 2)
    data = json.loads(invoke(*common, "--cache", "56", "-o", "sinks=3", "--block", "16").stdout)
    assert (data["cache"], data["block"], data["params"]["sinks"]) == (56, 16, 3)
    result = invoke(*common, "--preset", "nosuch")
    assert result.exit_code == 2 and "unknown preset" in result.stderr


def test_needle_grid_json_and_table(invoke, tiny_model_dir, tmp_path):
    from kvcli.methods import METHODS

    text = tmp_path / "haystack.txt"
    text.write_text(TEXT * 3)
    methods = "streamingllm,snapkv" if "snapkv" in METHODS else "streamingllm,full"
    common = ["needle", str(text), *tiny(tiny_model_dir), "--methods", methods, "--lengths", "300", "--depths",
              "0.25,75%", "--trials", "2", "--cache", "48", "--block", "32", "--out", str(tmp_path / "out"),
              "--max-new-tokens", "3"]
    data = json.loads(invoke(*common, "--json").stdout)
    assert (tmp_path / "out" / "needle.png").read_bytes()[:4] == b"\x89PNG"  # drawn by default, --json or not
    assert len(data["trials"]) == 2 * 2 * 2
    first = data["trials"][0]
    assert {"method", "length", "depth", "trial", "key", "answer", "correct", "prompt_tokens"} <= set(first)
    assert 4 <= len(first["key"]) <= 7 and first["key"].isdigit()
    assert data["answer_prefix"] == "" and not data["fixed"]  # the user's path: no answer prefix
    assert {t["question"] for t in data["trials"]} <= set(data["questions"]) and len(data["questions"]) > 1
    for t in data["trials"]:
        assert t["needle"] in data["needles"]
    assert {t["depth"] for t in data["trials"]} == {0.25, 0.75}
    assert [(r["method"], r["trials"]) for r in data["accuracy"]] == [(m, 4) for m in methods.split(",")]
    assert len(data["by_depth"]) == 4 and all(0 <= r["accuracy"] <= 1 for r in data["by_depth"])
    for row in data["accuracy"] + data["by_depth"]:  # each rate inside its 95% Wilson interval
        low, high = row["ci95"]
        assert 0 <= low <= row["accuracy"] <= high <= 1 and high - low > 0.2
    # every method saw the same keys
    keys = {m: [t["key"] for t in data["trials"] if t["method"] == m] for m in methods.split(",")}
    assert len({tuple(k) for k in keys.values()}) == 1
    first_plot = (tmp_path / "out" / "needle.png").read_bytes()
    table = invoke(*common[:-1], "1").stdout
    assert "pass-key accuracy" in table and "by depth" in table and "300 tokens" in table and "95% CI" in table
    # A second run into the same --out keeps the first run's plot and draws its own beside it.
    assert (tmp_path / "out" / "needle.png").read_bytes() == first_plot
    assert (tmp_path / "out" / "needle-2.png").read_bytes()[:4] == b"\x89PNG"


def test_needle_fixed_harness_and_answer_prefix(invoke, tiny_model_dir, tmp_path):
    """--fixed hides the one needle with five-digit keys and asks the one question; --answer-prefix starts the
    answer, as `ask --answer-prefix` does."""
    from kvcli.eval.needle import NEEDLE, QUESTION

    text = tmp_path / "haystack.txt"
    text.write_text(TEXT * 3)
    data = json.loads(invoke("needle", str(text), *tiny(tiny_model_dir), "--methods", "streamingllm", "--lengths",
                             "200", "--depths", "0.5", "--trials", "3", "--cache", "48", "--max-new-tokens", "1",
                             "--fixed", "--answer-prefix", "The pass key is ", "--json", "--no-plots").stdout)
    assert data["fixed"] and data["answer_prefix"] == "The pass key is "
    assert all(t["needle"] == NEEDLE and t["question"] == QUESTION and len(t["key"]) == 5 for t in data["trials"])


def test_needle_rows_resume_a_killed_run_and_refuse_another_run(invoke, tiny_model_dir, tmp_path):
    """--rows writes each trial as it finishes; --resume after a kill takes those and runs the rest, so the
    result is the uninterrupted run's. Rows of another book, setting or method parameter are refused, never mixed."""
    text = tmp_path / "haystack.txt"
    text.write_text(TEXT * 3)
    rows = tmp_path / "trials.jsonl"
    common = ["needle", str(text), *tiny(tiny_model_dir), "--methods", "streamingllm", "--lengths", "200", "--depths",
              "0.3,0.7", "--trials", "2", "--cache", "48", "--max-new-tokens", "2", "--json", "--no-plots",
              "--rows", str(rows)]
    whole = json.loads(invoke(*common).stdout)
    lines = rows.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == [t["key"] for t in whole["trials"]] and len(lines) == 4

    rows.write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])  # killed while writing the third trial
    resume = [*(arg for arg in common if arg != "--quiet"), "--resume"]  # with its note on stderr
    loud = invoke(*resume)
    assert loud.exit_code == 0 and f"took 2 of 4 trials from {rows}; reading the other 2" in loud.stderr
    resumed = json.loads(loud.stdout)

    def without_time(data):
        return [{k: v for k, v in t.items() if k != "seconds"} for t in data["trials"]]

    assert without_time(resumed) == without_time(whole) and resumed["accuracy"] == whole["accuracy"]
    # the first two were taken from the file (their recorded times), the last two read again
    assert [t["seconds"] for t in resumed["trials"][:2]] == [t["seconds"] for t in whole["trials"][:2]]
    assert [json.loads(line)["key"] for line in rows.read_text().splitlines()] == [t["key"] for t in whole["trials"]]
    complete = invoke(*resume)  # every trial there: the tables only
    assert f"took 4 of 4 trials from {rows}; none left to read" in complete.stderr
    assert without_time(json.loads(complete.stdout)) == without_time(whole)
    # a row graded by an older, looser grader counts as the strict grader says: the key inside a longer number misses
    loose = [json.loads(line) for line in rows.read_text().splitlines()]
    loose[0].update(answer=f"The pass key is {loose[0]['key']}0.", correct=True)
    rows.write_text("".join(json.dumps(row) + "\n" for row in loose))
    regraded = json.loads(invoke(*resume).stdout)["trials"]
    assert regraded[0]["correct"] is False and regraded[0]["answer"] == loose[0]["answer"]

    other = tmp_path / "other.txt"
    other.write_text(TEXT[::-1] * 3)
    for change, message in ((["--cache", "56"], "its cache is 48, this run's 56"),
                            (["-o", "sinks=2"], "its params"),
                            (["--trials", "3"], "its trials is 2"),
                            ([str(other)], "its tokens")):
        args = [str(other), *common[2:]] if change == [str(other)] else [*common[1:], *change]
        result = invoke("needle", *args, "--resume")
        assert result.exit_code == 1 and "is a trial of another run" in result.stderr and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert len(rows.read_text().splitlines()) == 4  # a refused resume leaves the file as it was

    # rows read with another framing of the question (an earlier kvcli's ASK_FRAME) are another run
    assert whole["frame"] == "\n\n" + ASK_FRAME + "<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's chat template
    framed = tmp_path / "framed.jsonl"
    old_rows = [json.loads(line) for line in rows.read_text().splitlines()]
    for row in old_rows:
        row["run"]["frame"] = "Answer the question about the text above.\nQuestion: {question}"
    framed.write_text("".join(json.dumps(row) + "\n" for row in old_rows))
    result = invoke(*[str(framed) if a == str(rows) else a for a in common], "--resume")
    assert result.exit_code == 1 and "its frame is 'Answer the question" in result.stderr

    result = invoke(*[a for a in common if a not in ("--rows", str(rows))], "--resume")
    assert result.exit_code == 2 and "--resume needs --rows" in result.stderr
    rows.write_text('{"document": "book.txt", "ppl": 12.5}\n')  # a ppl rows file
    result = invoke(*common, "--resume")
    assert result.exit_code == 1 and 'not a row of kvcli (one JSON object with a "trial"' in result.stderr


def test_needle_method_options(invoke, tiny_model_dir, tmp_path, monkeypatch):
    from kvcli.methods import METHODS

    monkeypatch.chdir(tmp_path)  # --no-plots: nothing is written to the default --out ./needle

    if "snapkv" not in METHODS:
        pytest.skip("snapkv is not registered yet")
    text = tmp_path / "haystack.txt"
    text.write_text(TEXT)
    common = ["needle", str(text), *tiny(tiny_model_dir), "--methods", "streamingllm,snapkv", "--lengths", "200",
              "--depths", "0.5", "--cache", "48", "--max-new-tokens", "1", "--json", "--no-plots"]
    data = json.loads(invoke(*common, "-o", "kernel=3", "-o", "streamingllm.sinks=2").stdout)
    assert data["params"]["snapkv"]["kernel"] == 3 and data["params"]["streamingllm"]["sinks"] == 2
    for option, message in (("nosuch=1", "none of"), ("treekv.sinks=1", "not one of --methods")):
        result = invoke(*common, "-o", option)
        assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "needle").exists()


def test_needle_writes_as_many_tokens_as_an_answer_with_a_long_key_needs(smol_tokenizer):
    """The CLI's default (a literal: kvcli.eval.needle imports torch) is the library's, long enough for "The pass key
    mentioned in the text is 7117200." in SmolLM2's tokens (one a digit), which the former 12 cut short."""
    import inspect

    from kvcli.cli.needle import needle
    from kvcli.eval.needle import ANSWER_TOKENS, run_grid
    from kvcli.reading.prompts import encode

    assert inspect.signature(needle).parameters["max_new_tokens"].default == ANSWER_TOKENS
    assert inspect.signature(run_grid).parameters["max_new_tokens"].default == ANSWER_TOKENS
    answer = encode(smol_tokenizer, "The pass key mentioned in the text is 7117200.")
    assert 12 < len(answer) < ANSWER_TOKENS  # and an end-of-turn token after it


def test_a_read_takes_blocks_of_1024_on_every_device_unless_told():
    """``--block auto`` of ``ask``, ``summarize`` and ``needle`` is READ_BLOCK, the library's needle default too
    (chosen on the tuning books: docs/results.md); ``ppl`` keeps the engine's default per device."""
    import inspect

    from kvcli.cli.options import READ_BLOCK, parse_block, parse_read_block
    from kvcli.eval.needle import run_grid

    assert parse_read_block("auto") == READ_BLOCK == 1024 and parse_read_block("64") == 64
    assert parse_block("auto") is None  # the engine's default for the device
    assert inspect.signature(run_grid).parameters["block"].default == READ_BLOCK


@pytest.mark.parametrize("length", [300, 900])  # read in one shot / streamed past the tiny model's 512 context
def test_a_needle_trial_answers_what_ask_answers_on_its_haystack(invoke, tiny_model_dir, smol_tokenizer, tmp_path,
                                                                  length):
    """needle's headline tables are the user's path: each trial's answer is what `kvcli ask HAYSTACK QUESTION`
    prints for the same text, with the same method, cache and block, and no option besides."""
    from kvcli.eval.needle import book_tokens, haystacks
    from kvcli.io.documents import open_source

    book = tmp_path / "book.txt"
    book.write_text(TEXT * 6)
    common = [*tiny(tiny_model_dir), "--cache", "48", "--block", "64", "--max-new-tokens", "4"]
    data = json.loads(invoke("needle", str(book), "--methods", "snapkv", "--lengths", str(length), "--depths", "0.4",
                             "--trials", "2", "--json", "--no-plots", *common).stdout)
    tokens = book_tokens(open_source(str(book)), smol_tokenizer, length * 2)
    stacks = list(haystacks(smol_tokenizer, tokens, [length], [0.4], 2))
    assert [s.key for s in stacks] == [t["key"] for t in data["trials"]]  # the same draws, rebuilt from the seed
    for stack, trial in zip(stacks, data["trials"], strict=True):
        text = smol_tokenizer.decode(stack.doc)
        assert smol_tokenizer.encode(text, add_special_tokens=False) == stack.doc  # it reads back as the same ids
        haystack = tmp_path / f"haystack-{stack.trial}.txt"
        haystack.write_text(text)
        asked = json.loads(invoke("ask", str(haystack), stack.question, "--method", "snapkv", *common, "--json").stdout)
        assert asked["answer"].strip() == trial["answer"]
        assert (asked["prompt_tokens"], asked["one_shot"]) == (trial["prompt_tokens"], trial["one_shot"])
        assert trial["one_shot"] == (length < 512)
