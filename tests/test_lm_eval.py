"""kvcli as the lm-eval model ``kvcli``: local tasks (a YAML and a JSONL written here, nothing downloaded),
the three request types, rolling scores against ``kvcli ppl``, and argument errors before any model loads."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

import kvcli  # noqa: E402
import kvcli.integrations.lm_eval  # noqa: E402, F401 - registers the model "kvcli" with lm-eval
from kvcli.errors import UsageError  # noqa: E402
from kvcli.integrations.lm_eval import KvcliLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROLLING = """task: kvcli_test_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
CHOICE = """task: kvcli_test_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATE = """task: kvcli_test_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_task(folder: Path, name: str, template: str, rows: list[dict]) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(template.format(data=data), encoding="utf-8")


def evaluate(folder: Path, tasks: list[str], model_args: str, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model="kvcli", model_args=model_args, tasks=tasks, device="cpu",
                                   task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                   **kwargs)


@pytest.fixture(scope="module")
def excerpt(books) -> str:
    """About 480 tokens of Alice: under the tiny model's trained context of 512 positions."""
    text = (books / "pg11-alice-in-wonderland.txt").read_text(encoding="utf-8")
    start = text.index("CHAPTER II.")
    return text[start:start + 1800]


def test_rolling_with_full_matches_kvcli_ppl_in_bits_per_byte_and_word_perplexity(invoke, tiny_model_dir, excerpt,
                                                                                  tmp_path):
    """The issue's check: lm-eval's perplexity of a text equals ``kvcli ppl --method full`` on the same text.

    lm-eval also scores the text's first token, after a prefix token kvcli ppl does not read (SmolLM2's
    tokenizer adds no BOS); over ~480 tokens that is 0.2 % in bits per byte, within the 0.5 % asked.
    """
    book = tmp_path / "excerpt.txt"
    book.write_text(excerpt, encoding="utf-8")
    ppl = invoke("ppl", str(book), "--model", str(tiny_model_dir), "--method", "full", "--dtype", "float32", "--json")
    assert ppl.exit_code == 0, ppl.stderr
    kvcli_run = json.loads(ppl.stdout)
    write_task(tmp_path, "rolling", ROLLING, [{"text": excerpt}])
    out = evaluate(tmp_path, ["kvcli_test_rolling"], f"model={tiny_model_dir},method=full,dtype=float32")
    got = out["results"]["kvcli_test_rolling"]
    bits = got["bits_per_byte,none"]
    assert kvcli_run["bytes"] == len(excerpt.encode("utf-8"))
    assert bits == pytest.approx(kvcli_run["bits_per_byte"], rel=0.005)
    assert bits > kvcli_run["bits_per_byte"]  # one more token scored, against a text that is the same otherwise
    # word and byte perplexity are the same log-likelihood over other units: consistent with kvcli's
    words = len(excerpt.split())
    assert got["byte_perplexity,none"] == pytest.approx(2 ** bits, rel=1e-9)
    nats = kvcli_run["nll"] * kvcli_run["tokens"]
    assert math.log(got["word_perplexity,none"]) == pytest.approx(nats / words, rel=0.005)


def test_loglikelihood_with_full_equals_the_engine_scoring_the_whole_stream(tiny_model_dir):
    """Under full attention, a continuation read after its context scores as in one stream (``kvcli ppl``'s
    path, an independent code path here), and greedy is true exactly for the argmax continuation."""
    from kvcli.engine.engine import Engine
    from kvcli.methods import make_method

    lm = KvcliLM(model=str(tiny_model_dir), method="full", dtype="float32", block=8)
    context = lm.tok_encode("Alice was beginning to get very tired of sitting by her sister on the bank")
    continuation = lm.tok_encode(" and of having nothing to do")
    logprob, greedy = lm.score_continuation(context, continuation)
    engine = Engine(lm.loaded.model, make_method("full"), None, block=64)
    expected = engine.score([context + continuation], score_from=len(context)).nll_sum
    assert logprob == pytest.approx(-expected, rel=1e-4)
    assert not greedy  # a random model does not write English

    best: list[int] = []
    for _ in range(3):  # the greedy continuation, one argmax at a time, each from a fresh full-attention read
        hidden = engine.forward(engine.new_cache(), torch.tensor([context + best]))
        best.append(int(engine.logits(hidden[-1:])[0].argmax()))
    assert lm.score_continuation(context, best)[1]


def test_compression_changes_what_the_continuation_sees(tiny_model_dir):
    """A context longer than the budget is compressed before the continuation is scored: the score moves."""
    context = KvcliLM(model=str(tiny_model_dir), method="full", dtype="float32").tok_encode(
        "It was the best of times, it was the worst of times, it was the age of wisdom, " * 6)
    continuation = [100, 200, 300]
    # Both read in the same blocks, so the one difference is what the method dropped. A random model's attention is
    # nearly uniform, so the move is small (about 1e-4 of the score), though far above float noise.
    full = KvcliLM(model=str(tiny_model_dir), method="full", dtype="float32", block=16, one_shot="false")
    small = KvcliLM(model=str(tiny_model_dir), method="streamingllm", cache=16, sinks=2, dtype="float32", block=16,
                    one_shot="false")
    assert small.engine.method.sinks == 2  # any other model_args key is a method parameter
    assert small.score_continuation(context, continuation)[0] != pytest.approx(
        full.score_continuation(context, continuation)[0], rel=1e-6)


def test_multiple_choice_and_generation_tasks_run_through_compression(tiny_model_dir, tmp_path):
    """lm-eval's scores are kvcli's: each choice's log-likelihood is what the adapter scores on its own, so with
    one answer set to the model's favourite and one to the other choice ``acc`` is exactly 1/2; a generation
    task whose first target is what the adapter writes and whose second is not gets ``exact_match`` 1/2."""
    args = {"model": str(tiny_model_dir), "method": "treekv", "cache": 16, "block": 8}
    lm = KvcliLM(**args)
    questions = ["The capital of France is", "It was the best of times, it was the worst of"]
    choices = [" Paris", " Rome"]
    scores = [[lm.score_continuation(*lm._encode_pair(question, " " + choice))[0] for choice in choices]
              for question in questions]
    favourite = [max(range(2), key=row.__getitem__) for row in scores]
    answers = [favourite[0], 1 - favourite[1]]
    write_task(tmp_path, "choice", CHOICE, [{"question": question, "choices": choices, "answer": answer}
                                            for question, answer in zip(questions, answers, strict=True)])
    prompts = ["Q: What is two plus two?\nA:", "Q: Who wrote Hamlet?\nA:"]
    written = lm.generate(prompts[0], {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})
    assert "\n" not in written  # cut at `until`
    write_task(tmp_path, "generate", GENERATE, [{"question": prompts[0], "answer": written},
                                                {"question": prompts[1], "answer": written + " and more"}])
    model_args = ",".join(f"{key}={value}" for key, value in args.items())
    out = evaluate(tmp_path, ["kvcli_test_choice", "kvcli_test_generate"], model_args, log_samples=True)
    assert out["results"]["kvcli_test_choice"]["acc,none"] == 0.5
    assert out["results"]["kvcli_test_generate"]["exact_match,none"] == 0.5
    for sample in out["samples"]["kvcli_test_choice"]:
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(scores[questions.index(sample["doc"]["question"])], rel=1e-5)


def test_apply_chat_template_reads_the_conversation_in_the_models_chat_template(tiny_model_dir, tmp_path, monkeypatch):
    """``--apply_chat_template``: lm-eval hands kvcli the task's turn rendered by the tokenizer's template, and
    the answer is what the adapter writes after that text."""
    write_task(tmp_path, "generate", GENERATE, [{"question": "Q: What is two plus two?\nA:", "answer": " 4"}])
    args = f"model={tiny_model_dir},method=streamingllm,cache=32,block=8"
    out = evaluate(tmp_path, ["kvcli_test_generate"], args, log_samples=True, apply_chat_template=True)
    (sample,) = out["samples"]["kvcli_test_generate"]
    context, gen_kwargs = sample["arguments"][0]
    assert context.startswith("<|im_start|>") and "What is two plus two?" in context
    assert context.endswith("<|im_start|>assistant\n")  # the generation prompt: the assistant writes next
    lm = KvcliLM(model=str(tiny_model_dir), method="streamingllm", cache=32, block=8)
    assert context == lm.apply_chat_template([{"role": "user", "content": "Q: What is two plus two?\nA:"}])
    assert sample["resps"][0][0] == lm.generate(context, gen_kwargs)
    prefill = lm.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}],
                                     add_generation_prompt=False)
    assert prefill.endswith("<|im_start|>assistant\nThe")  # continued, not closed with <|im_end|>
    # a base model; monkeypatch restores the template: the loaded model and its tokenizer are shared by later tests
    monkeypatch.setattr(lm.tokenizer, "chat_template", None)
    with pytest.raises(UsageError, match="has no chat template: run without --apply_chat_template"):
        lm.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_generation_is_greedy_and_stops_at_max_gen_toks(tiny_model_dir):
    lm = KvcliLM(model=str(tiny_model_dir), method="streamingllm", cache=16, block=8, dtype="float32")
    context = "It was the best of times, it was the worst of times, it was the age of wisdom."
    short = lm.generate(context, {"until": [], "max_gen_toks": 2})
    longer = lm.generate(context, {"until": [], "max_gen_toks": 6})
    assert longer.startswith(short.rstrip("\ufffd")) and len(longer) > len(short)
    assert lm.generate(context, {"until": [], "max_gen_toks": 6}) == longer  # greedy: the same every time


@pytest.mark.parametrize(("args", "message"), [
    ({"kv_bits": 3}, "kv_bits=3"),
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"method": "streamingllm", "sinkz": 4}, "has no parameter 'sinkz'"),
    ({"block": "x"}, "block must be a number of tokens or auto"),
    ({"cache": "lots"}, "cache must be a whole number"),
    ({"one_shot": "maybe"}, "one_shot must be true, false or auto"),
    ({"method": "streamingllm", "cache": 2, "sinks": 4}, "cache 2 is smaller than"),
])
def test_bad_model_args_are_one_clear_error(tiny_model_dir, args, message):
    with pytest.raises(UsageError, match=message):
        KvcliLM(model=str(tiny_model_dir), **args)


def test_python_m_kvcli_lm_eval_is_lm_evals_cli_and_a_mistake_is_one_line(tmp_path):
    write_task(tmp_path, "rolling", ROLLING, [{"text": "x"}])
    result = subprocess.run([sys.executable, "-m", "kvcli.integrations.lm_eval", "--model", "kvcli",
                             "--model_args", "kv_bits=3",
                             "--tasks", "kvcli_test_rolling", "--include_path", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("kvcli: error: kv_bits=3")
    assert "Traceback" not in result.stderr


def test_nothing_in_kvcli_but_the_adapter_imports_lm_eval():
    """lm-eval is an optional extra: the library and the CLI must run without it."""
    root = Path(kvcli.__file__).parent
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[:2] == ("integrations", "lm_eval"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.split(".")[0] == "lm_eval" or name.startswith("kvcli.integrations.lm_eval")
                           for name in names), path


def test_python_m_kvcli_lm_eval_runs_a_local_task_offline(tiny_model_dir, tmp_path):
    """The documented command line, ``python -m kvcli.integrations.lm_eval --model kvcli ...`` in a fresh
    interpreter, runs a local task offline and gives the score lm-eval driven from Python gives."""
    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 24
    write_task(tmp_path, "rolling", ROLLING, [{"text": text}])
    args = f"model={tiny_model_dir},method=treekv,cache=256"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "kvcli.integrations.lm_eval", "--model", "kvcli", "--model_args", args, "--tasks",
               "kvcli_test_rolling", "--include_path", str(tmp_path), "--device", "cpu", "--output_path",
               str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (path,) = (tmp_path / "out").rglob("results_*.json")
    got = json.loads(path.read_text(encoding="utf-8"))["results"]["kvcli_test_rolling"]
    expected = evaluate(tmp_path, ["kvcli_test_rolling"], args)["results"]["kvcli_test_rolling"]
    assert got["bits_per_byte,none"] > 0
    assert got["bits_per_byte,none"] == pytest.approx(expected["bits_per_byte,none"], rel=1e-6)


def test_an_installed_kvcli_adds_nothing_to_python_start_up(tmp_path):
    """A wheel of kvcli (what ``pip install`` unpacks) holds the package and its metadata only: no ``.pth`` that
    Python would run at every start, no top-level module, and no entry point for lm-eval, which reads none."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "kvcli", source / "kvcli", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             str(source), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("kvcli-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points).decode()
    assert not [name for name in names if name.endswith(".pth")]
    assert {name.split("/")[0] for name in names} == {"kvcli", wheel.name.split("-py")[0] + ".dist-info"}
    assert "[console_scripts]" in declared and "lm_eval" not in declared
