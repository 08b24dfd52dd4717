"""``kvcli bench``: the grid, results.json, resuming, plots, and errors caught before the model loads."""

from __future__ import annotations

import json

import pytest

import kvcli.eval.bench.grid
import kvcli.eval.bench.plots
from kvcli.eval.bench import RunSpec, plan_grid, plot_results, smooth_curve
from kvcli.kv.quant import POSITION_BYTES

RUN_KEYS = {"model", "source", "method", "params", "cache", "block", "tokens", "nll", "ppl", "bits_per_byte", "bytes",
            "kv_cache_bytes", "full_kv_cache_bytes", "max_cache_tokens", "peak_memory_bytes", "seconds",
            "tokens_per_second", "device", "dtype", "curve", "finished"}
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 8


@pytest.fixture()
def alice(books):
    return str(books / "pg11-alice-in-wonderland.txt")


def grid_args(model, alice, out, *extra: str) -> list[str]:
    return [alice, "--model", str(model), "--methods", "full,streamingllm,treekv", "--cache", "32,64", "--block",
            "16", "--max-tokens", "200", "--out", str(out), *extra]


def test_grid_writes_results_table_and_plots(invoke, tiny_model_dir, alice, tmp_path):
    out = tmp_path / "out"
    result = invoke("bench", *grid_args(tiny_model_dir, alice, out))
    assert result.exit_code == 0, result.stderr
    assert "perplexity" in result.stdout and "treekv" in result.stdout and "bits/byte" in result.stdout
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert [(r["method"], r["cache"]) for r in runs] == [("full", None), ("streamingllm", 32), ("streamingllm", 64),
                                                           ("treekv", 32), ("treekv", 64)]
    assert data["tokens"] == 200 and data["block"] == 16 and data["model"] == str(tiny_model_dir)
    for run in runs:
        assert RUN_KEYS <= set(run)
        assert run["tokens"] == 200 and run["ppl"] == pytest.approx(2.718281828 ** run["nll"], rel=1e-6)
        assert run["curve"][-1][0] == 200 and len(run["curve"]) == 13  # 201 tokens in blocks of 16
        if run["cache"] is not None:
            assert run["max_cache_tokens"] <= run["cache"] and run["kv_cache_bytes"] < run["full_kv_cache_bytes"]
    # full holds every key and value an uncompressed cache holds, and each token's positions (2 layers, 2 KV heads)
    assert runs[0]["kv_cache_bytes"] == runs[0]["full_kv_cache_bytes"] + 201 * 2 * 2 * POSITION_BYTES
    # KL against the one full-attention reference beside results.json: full matches it exactly
    assert (out / "reference.kvlogits").is_file()
    assert runs[0]["kl_mean"] == 0.0 and runs[0]["same_top"] == 1.0 and runs[0]["kl_tokens"] == 200
    assert all(run["kl_mean"] > 0 and run["kl_p99"] >= run["kl_mean"] for run in runs[1:])
    assert "KL vs full" in result.stdout and "same top" in result.stdout
    for name in ("ppl_vs_cache.png", "nll_vs_position.png"):  # matplotlib is a dependency: always drawn
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_plain_bench_draws_pngs_beside_results_and_no_plots_draws_none(invoke, tiny_model_dir, alice, tmp_path):
    """The issue's check: after the plain install, `kvcli bench ... --out DIR` leaves pictures beside results.json."""
    common = [alice, "--model", str(tiny_model_dir), "--methods", "streamingllm", "--cache", "16,32", "--block", "16",
              "--max-tokens", "48", "--no-kl"]
    drawn = invoke("bench", *common, "--out", str(tmp_path / "drawn"))
    assert drawn.exit_code == 0, drawn.stderr
    pngs = sorted(p.name for p in (tmp_path / "drawn").glob("*.png"))
    assert pngs == ["nll_vs_position.png", "ppl_vs_cache.png"] and "warning" not in drawn.stderr
    assert all((tmp_path / "drawn" / name).read_bytes()[:4] == b"\x89PNG" for name in pngs)
    for flag in ("--no-plots", "--no-plot"):  # --no-plot: the earlier spelling, still accepted
        skipped = invoke("bench", *common, "--out", str(tmp_path / flag), flag)
        assert skipped.exit_code == 0, skipped.stderr
        assert (tmp_path / flag / "results.json").is_file() and not list((tmp_path / flag).glob("*.png"))


def test_rerun_skips_finished_runs_without_measuring(invoke, tiny_model_dir, alice, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert invoke("bench", *grid_args(tiny_model_dir, alice, out, "--no-plots")).exit_code == 0
    before = (out / "results.json").read_bytes()

    def fail(*args, **kwargs):
        raise AssertionError("a finished run was measured again")

    monkeypatch.setattr(kvcli.eval.bench.grid, "measure", fail)
    result = invoke("bench", *grid_args(tiny_model_dir, alice, out, "--json"))
    assert result.exit_code == 0
    assert "skipping 5 finished runs" in result.stderr
    assert (out / "results.json").read_bytes() == before
    data = json.loads(result.stdout)
    assert data["skipped"] == 5 and data["measured"] == 0 and len(data["runs"]) == 5

    table = invoke("bench", *grid_args(tiny_model_dir, alice, out, "--no-plots", "--markdown")).stdout
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[1].strip() == "method" and set(rows[1]) <= set("|-: ")
    assert len(rows) == 2 + 5 and rows[2].split("|")[1].strip() == "full"


def test_no_kl_runs_no_reference(invoke, tiny_model_dir, alice, tmp_path):
    out = tmp_path / "out"
    result = invoke("bench", alice, "--model", str(tiny_model_dir), "--methods", "streamingllm", "--cache", "48",
                    "--block", "16", "--max-tokens", "64", "--out", str(out), "--json", "--no-plots", "--no-kl")
    assert result.exit_code == 0 and not (out / "reference.kvlogits").exists()
    assert "kl_mean" not in json.loads(result.stdout)["runs"][0]


def test_json_stdout_is_one_object(invoke, tiny_model_dir, alice, tmp_path):
    result = invoke("bench", alice, "--model", str(tiny_model_dir), "--methods", "streamingllm", "--cache", "48",
                    "--block", "16", "--max-tokens", "64", "--out", str(tmp_path / "out"), "--json", "--no-plots")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["tokens"] == 64 and data["interrupted"] is False and data["results"].endswith("results.json")
    assert [run["method"] for run in data["runs"]] == ["streamingllm"] and data["runs"][0]["curve"]


def test_bench_scores_what_ppl_stream_scores(invoke, tiny_model_dir, tmp_path):
    """The shared token stream is exactly `ppl --stream`'s: same tokens, bytes and perplexity."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    (folder / "b.txt").write_text(TEXT[::-1])
    common = ["--model", str(tiny_model_dir), "--block", "16", "--max-tokens", "150", "--json", "--quiet"]
    ppl = json.loads(invoke(*["ppl", str(folder), "--stream", "--method", "h2o", "--cache", "40",
                                         *common]).stdout)
    run = json.loads(invoke("bench", str(folder), "--methods", "h2o", "--cache", "40", "--out", str(tmp_path / "out"),
                           "--no-plots", *common).stdout)["runs"][0]
    for key in ("tokens", "bytes", "nll", "ppl", "bits_per_byte", "kv_cache_bytes", "full_kv_cache_bytes",
                "max_cache_tokens", "params"):
        assert run[key] == ppl[key], key


def test_interrupted_grid_keeps_finished_runs_and_resumes(invoke, tiny_model_dir, alice, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = [alice, "--model", str(tiny_model_dir), "--methods", "streamingllm,tova", "--cache", "32,64", "--block",
            "16", "--max-tokens", "120", "--out", str(out), "--no-plots"]
    real_measure = kvcli.eval.bench.grid.measure
    calls = []

    def interrupted_third(*a, **kw):  # what the engine reports when Ctrl-C lands in the third run
        totals, peak = real_measure(*a, **kw)
        calls.append(1)
        totals.interrupted = len(calls) == 3
        return totals, peak

    monkeypatch.setattr(kvcli.eval.bench.grid, "measure", interrupted_third)
    result = invoke("bench", *args)
    assert result.exit_code == 130
    assert "interrupted" in result.stdout and "streamingllm" in result.stdout and "tova" not in result.stdout
    first = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["cache"]) for r in first] == [("streamingllm", 32), ("streamingllm", 64)]
    assert not list(out.glob(".*tmp"))

    monkeypatch.setattr(kvcli.eval.bench.grid, "measure", real_measure)
    result = invoke("bench", *args)
    assert result.exit_code == 0 and "skipping 2 finished runs" in result.stderr
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["method"], r["cache"]) for r in runs] == [("streamingllm", 32), ("streamingllm", 64), ("tova", 32),
                                                         ("tova", 64)]
    assert runs[:2] == first


def test_other_settings_are_kept_and_only_exact_matches_skipped(invoke, tiny_model_dir, alice, tmp_path):
    out = tmp_path / "out"
    common = ["--model", str(tiny_model_dir), "--methods", "streamingllm", "--cache", "32", "--block", "16",
              "--out", str(out), "--json", "--quiet"]
    invoke("bench", alice, "--max-tokens", "100", *common, "--no-plots")
    longer = json.loads(invoke("bench", alice, "--max-tokens", "150", *common).stdout)
    assert longer["skipped"] == 0 and [r["tokens"] for r in longer["runs"]] == [150]
    options = json.loads(invoke("bench", alice, "--max-tokens", "150", *common, "-o", "sinks=2").stdout)
    assert options["skipped"] == 0 and options["runs"][0]["params"]["sinks"] == 2
    same = json.loads(invoke("bench", alice, "--max-tokens", "150", *common, "-o", "sinks=4").stdout)  # the default
    assert same["skipped"] == 1
    stored = json.loads((out / "results.json").read_text())["runs"]
    assert sorted((r["tokens"], r["params"]["sinks"]) for r in stored) == [(100, 4), (150, 2), (150, 4)]


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["--methods", "streamingllm,nosuch"], "unknown method 'nosuch'", 2),
        (["--cache", "256,abc"], "--cache", 2),
        (["--cache", "256,0"], "--cache must be a positive number", 2),
        (["--methods", "streamingllm", "--cache", "3"], "--cache 3", 2),
        (["-o", "nosuch=1"], "nosuch", 2),
        (["--max-tokens", "0"], "--max-tokens", 2),
        (["--out", "NOTRESULTS"], "not a kvcli bench results file", 1),
    ],
)
def test_bad_input_is_one_line_before_loading_the_model(invoke, args, message, code, tmp_path, monkeypatch, capsys):
    """--model does not exist: each error must come from checking the arguments, not from loading."""
    alice = tmp_path / "book.txt"
    alice.write_text(TEXT)
    bad_out = tmp_path / "other"
    bad_out.mkdir()
    (bad_out / "results.json").write_text("not json")
    args = [str(bad_out) if a == "NOTRESULTS" else a for a in args]
    result = invoke("bench", alice, "--model", "/no/such/model", "--out", tmp_path / "out", *args)
    assert result.exit_code == code, result.stderr
    assert result.stdout == ""
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_install_without_matplotlib_warns_once_and_writes_results(invoke, tiny_model_dir, alice, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr("kvcli.io.plots.have_matplotlib", lambda: False)
    out = tmp_path / "out"
    result = invoke("bench", alice, "--model", str(tiny_model_dir), "--methods", "streamingllm", "--cache", "32",
                    "--block", "16", "--max-tokens", "50", "--out", str(out))
    assert result.exit_code == 0
    assert result.stderr.count("warning") == 1 and "(pip install matplotlib)" in result.stderr  # the hint survives
    assert (out / "results.json").exists() and not list(out.glob("*.png"))


def test_plan_grid_runs_unbounded_methods_once_without_a_budget():
    specs = plan_grid(["full", "streamingllm", "full"], [64, 32, 64])
    assert specs == [RunSpec("full", None), RunSpec("streamingllm", 64), RunSpec("streamingllm", 32)]
    assert [spec.label for spec in specs] == ["full", "streamingllm · cache 64", "streamingllm · cache 32"]
    assert plan_grid(["full"], []) == [RunSpec("full", None)]  # no budget needed when every method is unbounded


def test_smooth_curve_weights_blocks_by_scored_tokens():
    curve = [[15, 1.0], [31, 3.0], [47, None], [63, 2.0]]  # blocks of 16; the first scores 15 tokens
    assert smooth_curve(curve, 16) == [(15, 1.0), (31, 3.0), (63, 2.0)]
    smoothed = dict(smooth_curve(curve, 32))
    assert smoothed[31] == pytest.approx((15 * 1.0 + 16 * 3.0) / 31)
    assert smoothed[47] == 3.0 and smoothed[63] == 2.0


def test_plots_of_runs_from_different_settings(tmp_path):
    """Runs of two models in one results.json become separate, labelled lines rather than one mixed line."""
    def run(model, method, cache, ppl):
        return {"model": model, "source": "/books/a.txt", "tokens": 64, "block": 16, "dtype": "float32",
                "device": "cpu", "method": method, "cache": cache, "params": {}, "ppl": ppl,
                "curve": [[15, 3.0], [31, 2.5], [47, 2.4], [63, 2.3]]}

    results = {"runs": [run("a", "full", None, 10.0), run("a", "streamingllm", 16, 12.0),
                        run("a", "streamingllm", 32, 11.0), run("b", "streamingllm", 32, 9.0)]}
    paths = plot_results(results, tmp_path)
    assert [p.name for p in paths] == ["ppl_vs_cache.png", "nll_vs_position.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    lines, common = kvcli.eval.bench.plots._series(results["runs"])
    assert set(lines) == {"full · a", "streamingllm · a", "streamingllm · b"}
    assert "64 tokens" in common
