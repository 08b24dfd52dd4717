"""kvcli as the lm-eval model ``kvcli``: local tasks (a YAML and a JSONL written here, nothing downloaded),
the three request types, rolling scores against ``kvcli ppl``, and argument errors before any model loads."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

import kvcli  # noqa: E402
import kvcli.lm_eval  # noqa: E402, F401 - registers the model "kvcli" with lm-eval
from kvcli.errors import UsageError  # noqa: E402
from kvcli.lm_eval import KvcliLM  # noqa: E402

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
    from kvcli.engine import Engine
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
    full = KvcliLM(model=str(tiny_model_dir), method="full", dtype="float32", block=16)
    small = KvcliLM(model=str(tiny_model_dir), method="streamingllm", cache=16, sinks=2, dtype="float32", block=16,
                    one_shot="false")
    assert small.engine.method.sinks == 2  # any other model_args key is a method parameter
    assert small.score_continuation(context, continuation)[0] != pytest.approx(
        full.score_continuation(context, continuation)[0], rel=1e-4)


def test_multiple_choice_and_generation_tasks_run_through_compression(tiny_model_dir, tmp_path):
    write_task(tmp_path, "choice", CHOICE, [{"question": "The capital of France is", "choices": [" Paris", " Rome"],
                                             "answer": 0}])
    write_task(tmp_path, "generate", GENERATE, [{"question": "Q: What is two plus two?\nA:", "answer": " 4"}])
    out = evaluate(tmp_path, ["kvcli_test_choice", "kvcli_test_generate"],
                   f"model={tiny_model_dir},method=treekv,cache=16,block=8", log_samples=True)
    assert out["results"]["kvcli_test_choice"]["acc,none"] in (0.0, 1.0)
    assert out["results"]["kvcli_test_generate"]["exact_match,none"] in (0.0, 1.0)
    (sample,) = out["samples"]["kvcli_test_generate"]
    assert isinstance(sample["resps"][0][0], str) and "\n" not in sample["resps"][0][0]  # cut at `until`


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
    result = subprocess.run([sys.executable, "-m", "kvcli.lm_eval", "--model", "kvcli", "--model_args", "kv_bits=3",
                             "--tasks", "kvcli_test_rolling", "--include_path", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("kvcli: error: kv_bits=3")
    assert "Traceback" not in result.stderr


def test_nothing_in_kvcli_but_the_adapter_imports_lm_eval():
    """lm-eval is an optional extra: the library and the CLI must run without it."""
    root = Path(kvcli.__file__).parent
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "lm_eval":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.split(".")[0] == "lm_eval" or name.startswith("kvcli.lm_eval") for name in names), path


def test_the_lm_eval_entry_point_names_the_registered_class():
    """lm-eval releases with plugins load ``lm_eval.models`` entry points: kvcli's must be the class the
    decorator registered, or the two registrations would collide."""
    from importlib.metadata import entry_points

    from lm_eval.api.registry import get_model

    (point,) = [p for p in entry_points(group="lm_eval.models") if p.name == "kvcli"]
    assert point.load() is KvcliLM is get_model("kvcli")


ROOT = Path(__file__).resolve().parents[1]
#: What pip puts in site-packages so that plain ``lm_eval --model kvcli`` works (setup.py, kvcli_lm_eval_hook.py).
HOOK_PTH = "kvcli_lm_eval_hook.pth"


def run_python(code: str, *flags: str) -> str:
    result = subprocess.run([sys.executable, *flags, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_start_up_hook_imports_nothing_but_itself():
    """The .pth runs ``import kvcli_lm_eval_hook`` at every Python start: no kvcli, torch or lm_eval then."""
    out = run_python("before = set(sys.modules)\nimport kvcli_lm_eval_hook as hook\n"
                     "print(sorted(set(sys.modules) - before), sys.meta_path[0] is hook.Finder)", "-S")
    assert out == "['kvcli_lm_eval_hook'] True"


def test_the_hook_registers_a_lazy_kvcli_when_lm_eval_loads_its_models():
    """lm-eval imports lm_eval.models (its built-in placeholders) on its first model look-up; the hook adds
    ``kvcli`` there as a placeholder of the same kind, and kvcli is imported only when that model is asked for."""
    out = run_python("""
import kvcli_lm_eval_hook as hook
from lm_eval.api.registry import get_model, model_registry
assert "kvcli" not in model_registry  # the registry alone: built-ins are not there yet, so neither is kvcli
import lm_eval.models
assert dict(model_registry.items())["kvcli"] == "kvcli.lm_eval:KvcliLM" and "hf" in model_registry
assert not {"kvcli", "torch"} & {name.split(".")[0] for name in sys.modules}, "the placeholder imported kvcli"
assert hook.Finder not in sys.meta_path
model = get_model("kvcli")
print(model.__module__, model.__name__)
""")
    assert out == "kvcli.lm_eval KvcliLM"


def test_plain_lm_eval_command_runs_kvcli_on_a_local_task_offline(tiny_model_dir, tmp_path):
    """The issue's check: ``lm_eval --model kvcli ...``, the console script pip installs with lm-eval, finds
    kvcli (through kvcli_lm_eval_hook.pth) and gives the same score as lm-eval driven from Python."""
    script = Path(sys.executable).with_name("lm_eval")
    pth = Path(sysconfig.get_paths()["purelib"], HOOK_PTH)
    if not pth.is_file():
        pytest.skip(f"{pth} is missing: kvcli is not pip-installed in this environment (or was installed before "
                    "the hook existed); pip install -e '.[dev]' adds it. python -m kvcli.lm_eval works without it")
    if not script.is_file():
        pytest.skip(f"no lm_eval console script beside {sys.executable}")
    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 24
    write_task(tmp_path, "rolling", ROLLING, [{"text": text}])
    args = f"model={tiny_model_dir},method=treekv,cache=256"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    command = [str(script), "--model", "kvcli", "--model_args", args, "--tasks", "kvcli_test_rolling",
               "--include_path", str(tmp_path), "--device", "cpu", "--output_path", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (path,) = (tmp_path / "out").rglob("results_*.json")
    got = json.loads(path.read_text(encoding="utf-8"))["results"]["kvcli_test_rolling"]
    expected = evaluate(tmp_path, ["kvcli_test_rolling"], args)["results"]["kvcli_test_rolling"]
    assert got["bits_per_byte,none"] > 0
    assert got["bits_per_byte,none"] == pytest.approx(expected["bits_per_byte,none"], rel=1e-6)
