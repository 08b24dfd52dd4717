"""Documents side by side (``kvcli ppl FOLDER --batch N``, issue #56): each document's numbers are those it gets
read alone, for every method, at every bit width, on a model with attention-window layers too."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.engine import batched
from kvcli.engine.batched import MOST_DOCUMENTS, choose_batch, document_bytes, forward_rows, score_documents
from kvcli.engine.engine import Engine
from kvcli.methods import make_method
from kvcli.models.load import tiny_llama

BLOCK = 16
LENGTHS = (130, 1, 16, 75, 33, 96, 5)  # blocks whole and cut, a one-token document, one shorter than a block


def documents(lengths=LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=generator) for n in lengths]


def alone_and_batched(engine: Engine, docs: list[torch.Tensor], batch: int):
    alone = [engine.score([doc]) for doc in docs]
    batched = dict(score_documents(engine, docs, batch))
    return alone, [batched[i] for i in range(len(docs))]


def assert_same(alone, batched) -> None:
    for one, other in zip(alone, batched, strict=True):
        assert (other.tokens, other.processed, other.max_cache_tokens) == (one.tokens, one.processed,
                                                                          one.max_cache_tokens)
        assert other.kv_cache_bytes == one.kv_cache_bytes
        assert other.nll_sum == pytest.approx(one.nll_sum, rel=1e-5, abs=1e-5)
        assert len(other.blocks) == len(one.blocks) and not other.interrupted


@pytest.mark.parametrize("method", ["full", "streamingllm", "h2o", "tova", "snapkv", "pyramidkv", "pyramidinfer",
                                    "treekv"])
def test_every_method_scores_each_document_batched_as_alone(tiny, method):
    engine = Engine(tiny, make_method(method, {}), 48, block=BLOCK)
    assert_same(*alone_and_batched(engine, documents(), batch=3))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_packed_cache_scores_each_document_batched_as_alone(tiny, bits):
    engine = Engine(tiny, make_method("snapkv", {}), 48, block=BLOCK, kv_bits=bits, warn=lambda message: None)
    assert_same(*alone_and_batched(engine, documents(), batch=4))


def test_pod_scores_each_document_batched_as_alone():
    from kvcli.methods.pod.groups import GroupsFile

    model = tiny_llama(num_layers=4, hidden=64, heads=4, kv_heads=2)
    pod = make_method("pod", {"groups": GroupsFile.separate(model.config), "sinks": 2, "recent": 8,
                              "select": "snapkv"})
    assert_same(*alone_and_batched(Engine(model, pod, 48, block=BLOCK), documents(), batch=3))


def test_window_layers_score_each_document_batched_as_alone():
    from test_families import build

    engine = Engine(build("gemma3"), make_method("treekv", {}), 48, block=BLOCK)
    assert_same(*alone_and_batched(engine, documents((120, 60, 17)), batch=3))


def test_ctrl_c_reports_the_documents_in_flight_as_interrupted(tiny, monkeypatch):
    engine = Engine(tiny, make_method("snapkv", {}), 48, block=BLOCK)
    calls = {"n": 0}

    def cut(engine, caches, ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return forward_rows(engine, caches, ids)

    monkeypatch.setattr(batched, "forward_rows", cut)
    finished = list(score_documents(engine, documents((64, 64, 64)), batch=3))
    assert [index for index, _ in finished] == [0, 1, 2]
    assert all(totals.interrupted and totals.processed == 2 * BLOCK for _, totals in finished)


def test_the_command_gives_each_document_its_numbers_batched_and_resumes(invoke, tiny_model_dir, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial boxer".split()
    for i, count in enumerate((300, 40, 180, 90, 260)):
        (folder / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(count)))
    common = ["ppl", str(folder), "--model", str(tiny_model_dir), "--method", "snapkv", "--cache", "32", "--block",
              "32", "--json"]
    alone = json.loads(invoke(*common).stdout)
    rows = tmp_path / "rows.jsonl"
    batched = invoke(*common, "--batch", "3", "--rows", str(rows))
    assert batched.exit_code == 0, batched.stderr
    batched = json.loads(batched.stdout)
    assert [d["name"] for d in batched["documents"]] == [d["name"] for d in alone["documents"]]
    for one, other in zip(alone["documents"], batched["documents"], strict=True):
        assert (other["tokens"], other["bytes"], other["max_cache_tokens"], other["kv_cache_bytes"]) == (
            one["tokens"], one["bytes"], one["max_cache_tokens"], one["kv_cache_bytes"])
        assert other["ppl"] == pytest.approx(one["ppl"], rel=1e-5)
    assert batched["ppl"] == pytest.approx(alone["ppl"], rel=1e-5)
    assert len(rows.read_text().splitlines()) == 5
    again = json.loads(invoke(*common, "--batch", "3", "--rows", str(rows), "--resume").stdout)
    assert again["job"]["resumed"] == 5 and again["ppl"] == batched["ppl"]


@pytest.mark.parametrize("extra", [["--batch", "0"], ["--batch", "many"], ["--batch", "2", "--stream"],
                                   ["--batch", "2", "--max-tokens", "9"],
                                   ["--batch", "2", "--context", "64", "--stride", "32"]])
def test_a_batch_with_a_one_stream_option_is_one_line(invoke, book, extra):
    result = invoke("ppl", str(book), *extra, "--model", "/nonexistent")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1


def test_auto_puts_in_flight_what_half_the_free_memory_holds(tiny):
    bounded = Engine(tiny, make_method("snapkv", {}), 48, block=BLOCK)
    each = document_bytes(bounded, 10**6)
    assert each == document_bytes(bounded, 10)  # a bounded cache costs the same whatever the document's length
    assert choose_batch(bounded, 10**6, 7 * each) == 3
    assert choose_batch(bounded, 10**6, each) == 1 and choose_batch(bounded, 10**6, 10**15) == MOST_DOCUMENTS
    unbounded = Engine(tiny, make_method("full", {}), None, block=BLOCK)
    assert document_bytes(unbounded, 10_000) > document_bytes(unbounded, 100)


def test_auto_on_a_cpu_reads_one_document_at_a_time(invoke, tiny_model_dir, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(2):
        (folder / f"doc{i}.txt").write_text("a few words of text, " * (20 + 10 * i))
    common = ["ppl", str(folder), "--model", str(tiny_model_dir), "--cache", "32", "--block", "32", "--json"]
    auto = invoke(*common, "--batch", "auto")
    assert auto.exit_code == 0 and "--batch auto" not in auto.stderr
    assert json.loads(auto.stdout)["ppl"] == json.loads(invoke(*common).stdout)["ppl"]


def test_ctrl_c_while_the_next_document_is_read_ends_the_run_the_same_way(tiny):
    engine = Engine(tiny, make_method("snapkv", {}), 48, block=BLOCK)
    docs = documents((16, 96, 40))

    def read():
        yield from docs
        raise KeyboardInterrupt

    finished = dict(score_documents(engine, read(), batch=2))  # 2 ends before 1, then the Ctrl-C comes
    assert [(i, finished[i].interrupted) for i in sorted(finished)] == [(0, False), (1, True), (2, False)]
    assert (finished[0].tokens, finished[2].tokens, finished[1].processed) == (15, 39, 4 * BLOCK)


@pytest.mark.parametrize("protocol", [{"stream": True}, {"context": 64, "stride": 32}, {"max_tokens": 9}])
def test_the_library_refuses_a_batch_with_a_one_stream_protocol_before_reading(tiny, protocol):
    from kvcli.errors import UsageError
    from kvcli.eval.perplexity import evaluate

    class Loaded:  # evaluate reads only these before it refuses
        device = torch.device("cpu")
        tokenizer = None

    engine = Engine(tiny, make_method("snapkv", {}), 48, block=BLOCK)
    with pytest.raises(UsageError, match="documents protocol only"):
        evaluate(Loaded(), [], engine, batch=2, **protocol)
