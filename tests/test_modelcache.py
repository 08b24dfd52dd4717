"""The model cache (kvcli/models/cache.py): a GGUF is converted once and read back identically, a changed file is
never served stale, an entry is complete or absent (kills, two first loads at once), a damaged entry is rebuilt
after one warning, a cache that cannot be written is skipped after one line; and ``kvcli cache``.

The loads use a tiny GGUF written here (a 2-layer Llama in Q4_1 with a byte-level tokenizer and a chat template,
converted in well under a second); the locking and atomic-build mechanics are also driven directly with a fake
conversion.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcli.models import cache as modelcache

CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SAMPLE = "the cat in the hat <|im_start|> sat on the mat <|im_end|> héllo"


def write_tiny_gguf(path: Path, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2) -> Path:
    """A tiny Llama GGUF: Q4_1 matrices (dequantized in the load's dtype, as real files are), fp32 norms,
    a byte-level BPE vocabulary with three control tokens, and a chat template. Seeds give files of one size."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hidden * 2)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT)

    def weight(name: str, *shape: int, packed: bool = True) -> None:
        data = rng.standard_normal(shape, dtype=np.float32) * 0.2
        if packed:
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(name, 1.0 + data * 0.1)

    kv = kv_heads * (hidden // heads)
    weight("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        weight(f"blk.{i}.attn_norm.weight", hidden, packed=False)
        weight(f"blk.{i}.attn_q.weight", hidden, hidden)
        weight(f"blk.{i}.attn_k.weight", kv, hidden)
        weight(f"blk.{i}.attn_v.weight", kv, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden)
        weight(f"blk.{i}.ffn_norm.weight", hidden, packed=False)
        weight(f"blk.{i}.ffn_gate.weight", hidden * 2, hidden)
        weight(f"blk.{i}.ffn_up.weight", hidden * 2, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, hidden * 2)
    weight("output_norm.weight", hidden, packed=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache of this test's own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVCLI_CACHE", str(folder))
    return folder


@pytest.fixture()
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def load_fresh(path: Path, dtype: str = "float32", warn=None):
    """Load as a new process would: the in-process memo of loaded models is bypassed."""
    from kvcli.models.load import discard, load_model

    loaded = load_model(str(path), device="cpu", dtype=dtype, warn=warn)
    discard(loaded)
    return loaded


def forget(path: Path, dtype: str = "auto") -> None:
    """Drop what ``kvcli ... --model PATH --device cpu`` loaded in this process, so the next command loads again."""
    from kvcli.models.load import discard, load_model

    discard(load_model(str(path), device="cpu", dtype=dtype))


def state(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_same_model(a, b) -> None:
    """Equal weights and buffers, dtypes included (each side a LoadedModel, a model or a state)."""
    import torch

    from kvcli.models.load import LoadedModel

    sa, sb = (x if isinstance(x, dict) else state(x.model if isinstance(x, LoadedModel) else x) for x in (a, b))
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def complete_entries() -> list:
    return [e for e in modelcache.entries() if e.problem is None]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_entry_loads_what_converting_the_gguf_gives(tiny_gguf, cache, dtype):
    """Same weights and buffers in the same dtype, same tokens, same chat template, same logits."""
    import torch

    from kvcli.models.load import _read_gguf, resolve_dtype

    cached = load_fresh(tiny_gguf, dtype)
    tokenizer, model = _read_gguf(tiny_gguf, {"dtype": resolve_dtype(dtype, torch.device("cpu"))})
    assert_same_model(cached, model)
    assert cached.tokenizer(SAMPLE).input_ids == tokenizer(SAMPLE).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert cached.tokenizer.apply_chat_template(messages, tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    assert cached.model.config.name_or_path == str(tiny_gguf.parent)  # as a direct load names it
    model.set_attn_implementation(cached.model.config._attn_implementation)  # kvcli's attention, as loaded
    ids = torch.tensor([cached.tokenizer(SAMPLE).input_ids])
    with torch.no_grad():
        assert torch.equal(cached.model(ids).logits, model(ids).logits)
    [entry] = complete_entries()
    assert entry.manifest["variant"]["dtype"] == dtype


def test_later_loads_read_the_entry_without_converting(tiny_gguf, cache, monkeypatch):
    from kvcli.models import load as models

    first = load_fresh(tiny_gguf)
    monkeypatch.setattr(models, "_read_gguf", lambda *a, **k: pytest.fail("converted a GGUF that was cached"))
    assert_same_model(load_fresh(tiny_gguf), first)
    assert len(complete_entries()) == 1


def test_each_dtype_has_its_own_entry(tiny_gguf, cache):
    """A GGUF dequantizes differently into each dtype, so the cache keeps what each load would have made."""
    load_fresh(tiny_gguf, "float32")
    load_fresh(tiny_gguf, "bfloat16")
    assert sorted(e.manifest["variant"]["dtype"] for e in complete_entries()) == ["bfloat16", "float32"]


def test_a_changed_file_is_never_served_stale(tiny_gguf, cache):
    """New bytes of the same size under the same mtime: the content hash tells them apart."""
    import torch

    from kvcli.models.load import _read_gguf

    old = load_fresh(tiny_gguf)
    before = tiny_gguf.stat()
    write_tiny_gguf(tiny_gguf, seed=1)
    os.utime(tiny_gguf, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert tiny_gguf.stat().st_size == before.st_size and tiny_gguf.stat().st_mtime_ns == before.st_mtime_ns
    new = load_fresh(tiny_gguf)
    _, direct = _read_gguf(tiny_gguf, {"dtype": torch.float32})
    assert_same_model(new, direct)
    assert not torch.equal(new.model.lm_head.weight, old.model.lm_head.weight)
    assert len(complete_entries()) == 2


def test_the_source_hash_is_remembered_only_while_the_file_is_unchanged(tmp_path, cache, monkeypatch):
    """A remembered hash is used while size, mtime, ctime, inode and device all match and its seal holds; any
    write changes ctime, and a memo edited by hand fails its seal: both are hashed again."""
    monkeypatch.setattr(modelcache, "RACY_SECONDS", -1.0)  # this file was just written: remember it anyway
    (cache / "models").mkdir(parents=True, mode=0o700)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"one")
    real = modelcache.file_sha256(source)
    [memo] = (cache / "models" / ".sources").iterdir()
    hashed = []
    full = modelcache._hashed
    monkeypatch.setattr(modelcache, "_hashed", lambda path: hashed.append(path) or full(path))
    assert modelcache.file_sha256(source) == real and hashed == []  # remembered: not read in full
    saved = json.loads(memo.read_text())
    memo.write_text(json.dumps({**saved, "sha256": "0" * 64}))  # edited by hand: the seal no longer holds
    assert modelcache.file_sha256(source) == real and len(hashed) == 1
    time.sleep(0.01)
    source.write_bytes(b"two")  # a new write: hashed again
    assert modelcache.file_sha256(source) not in (real, "0" * 64) and len(hashed) == 2


def test_a_just_written_file_is_hashed_again_on_every_load(tmp_path, cache):
    """A stat younger than RACY_SECONDS may not change on the next write, so its hash is not remembered."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"one")
    modelcache.file_sha256(source)
    assert not (cache / "models" / ".sources").exists()


def test_weights_cut_in_half_are_rebuilt_with_one_warning(tiny_gguf, cache, invoke, book):
    first = invoke("ppl", book, "--model", tiny_gguf, "--device", "cpu", "-n", "40", "--json")
    assert first.exit_code == 0, first.stderr
    [entry] = complete_entries()
    weights = entry.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "model.safetensors has" in modelcache.entries()[0].problem
    forget(tiny_gguf)
    second = invoke("ppl", book, "--model", tiny_gguf, "--device", "cpu", "-n", "40", "--json")
    assert second.exit_code == 0, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and "model.safetensors has" in lines[0], second.stderr
    assert json.loads(second.stdout)["nll"] == json.loads(first.stdout)["nll"]
    assert len(complete_entries()) == 1


@pytest.mark.parametrize("manifest", ["[]", "{", '{"format": 1, "files": {"../config.json": 2}}', '{"format": 99}'])
def test_a_manifest_that_is_not_kvclis_is_damage(tmp_path, manifest):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "config.json").write_text("{}")
    (entry / modelcache.MANIFEST).write_text(manifest)
    assert modelcache.check(entry) is not None


def test_weights_that_fail_to_load_are_rebuilt_with_one_warning(tiny_gguf, cache):
    """Damage of the right size (a zeroed header) is found when the entry fails to load, and rebuilt too."""
    # Loaded weights map the entry's file (copy-on-write), so keep a copy of them before damaging it.
    first = {name: tensor.clone() for name, tensor in state(load_fresh(tiny_gguf).model).items()}
    [entry] = complete_entries()
    weights = entry.path / "model.safetensors"
    weights.write_bytes(bytes(weights.stat().st_size))
    messages: list[str] = []
    again = load_fresh(tiny_gguf, warn=messages.append)
    assert len(messages) == 1 and "damaged" in messages[0], messages
    assert_same_model(again, first)
    assert len(complete_entries()) == 1


@pytest.mark.parametrize(("dtype", "fast", "warned"), [("bfloat16", False, True), ("bfloat16", True, False),
                                                     ("float32", False, False)])
def test_bf16_on_a_cpu_that_emulates_it_is_named_in_one_line(tiny_gguf, cache, monkeypatch, dtype, fast, warned):
    """Asking for bf16 where the CPU has no AMX or AVX512-BF16 still loads in bf16, after one line saying why the
    read will be slow; where bf16 is native, or the dtype is float32, nothing is said."""
    import torch

    from kvcli.models import load

    monkeypatch.setattr(load, "cpu_has_fast_bf16", lambda: fast)
    messages: list[str] = []
    loaded = load_fresh(tiny_gguf, dtype, warn=messages.append)
    assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)
    if warned:
        assert len(messages) == 1 and "emulated" in messages[0] and "--dtype bfloat16" in messages[0], messages
    else:
        assert messages == []


def test_a_cache_that_cannot_be_written_is_skipped_with_one_notice(tiny_gguf, tmp_path, monkeypatch):
    """A cache path that cannot be created (here: under a file, which stops root too) loads the GGUF directly."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVCLI_CACHE", str(blocker / "cache"))
    messages: list[str] = []
    loaded = load_fresh(tiny_gguf, warn=messages.append)
    assert len(messages) == 1 and "cannot be written" in messages[0] and "KVCLI_CACHE" in messages[0], messages
    assert loaded.tokenizer(SAMPLE).input_ids
    assert modelcache.entries() == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_still_serves_its_entries(tiny_gguf, cache, tmp_path):
    first = load_fresh(tiny_gguf)
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=2)
    for folder in (cache, cache / "models"):
        folder.chmod(0o555)
    try:
        messages: list[str] = []
        assert_same_model(load_fresh(tiny_gguf, warn=messages.append), first)
        assert messages == []
        load_fresh(other, warn=messages.append)
        assert len(messages) == 1 and "cannot be written" in messages[0]
    finally:
        for folder in (cache, cache / "models"):
            folder.chmod(0o755)


def test_a_corrupt_gguf_leaves_no_entry(tmp_path, cache, invoke, book):
    model = tmp_path / "junk.gguf"
    model.write_bytes(b"this is not a model\n" * 10)
    result = invoke("ppl", book, "--model", model, "--quiet")
    assert result.exit_code == 1 and str(model) in result.stderr and "Traceback" not in result.stderr
    assert modelcache.entries() == []


def _fake_convert(folder: Path, log: Path | None = None, pause: float = 0.0) -> None:
    if log is not None:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()}\n")
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    time.sleep(pause)
    (folder / "config.json").write_text("{}")


def _converted_in_child(source: str, log: str, out: multiprocessing.Queue) -> None:
    messages: list[str] = []
    path = modelcache.converted(Path(source), "fake", {"dtype": "x"}, lambda f: _fake_convert(f, Path(log), 0.5),
                                warn=messages.append)
    out.put((str(path), messages))


def converted_twice_at_once(source: Path, log: Path) -> list[tuple[str, list[str]]]:
    """Two forked processes ask the cache for ``source``'s entry at once: each one's path and warnings."""
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    children = [context.Process(target=_converted_in_child, args=(str(source), str(log), out)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    return [out.get(timeout=5) for _ in children]


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_two_first_loads_at_once_build_one_complete_entry(tmp_path, cache):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    log = tmp_path / "builds.log"
    results = converted_twice_at_once(source, log)
    assert [messages for _, messages in results] == [[], []], results
    assert results[0][0] == results[1][0]
    assert len(log.read_text().splitlines()) == 1  # the second waited for the first, then read its entry
    [entry] = modelcache.entries()
    assert entry.problem is None and str(entry.path) == results[0][0]


def test_two_processes_loading_a_new_gguf_at_once_both_succeed(tiny_gguf, cache):
    """End to end: two Python processes convert the same GGUF at once; both load it, one entry remains."""
    code = ("import sys; from kvcli.models.load import load_model; "
            "m = load_model(sys.argv[1], device='cpu', dtype='float32'); "
            "print(m.tokenizer('the cat').input_ids)")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]
    assert len(complete_entries()) == 1 and len(modelcache.entries()) == 1


def test_a_killed_build_leaves_no_entry_and_its_leftovers_are_removed(tmp_path, cache):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")

    def killed(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"x" * 10)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        modelcache.converted(source, "fake", {}, killed, warn=pytest.fail)
    assert modelcache.entries() == []
    # A SIGKILL runs no cleanup: its build folder stays until the next build of the same entry.
    path = modelcache.converted(source, "fake", {}, _fake_convert, warn=pytest.fail)
    leftover = path.parent / f".build-{path.name}-dead"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"x")
    assert [e.problem is None for e in modelcache.entries()] == [False, True]  # listed, as interrupted
    modelcache.discard(path)
    assert modelcache.converted(source, "fake", {}, _fake_convert, warn=pytest.fail) == path
    assert not leftover.exists()
    assert [e.path for e in modelcache.entries()] == [path]


def test_kvcli_cache_lists_and_clears(tiny_gguf, cache, invoke):
    empty = invoke("cache")
    assert empty.exit_code == 0 and "0 cached models" in empty.stdout and str(cache / "models") in empty.stdout
    load_fresh(tiny_gguf)
    [entry] = complete_entries()
    listed = invoke("cache", "list")
    assert entry.name in listed.stdout and str(tiny_gguf) in listed.stdout and "1 cached model," in listed.stdout
    assert "MiB" in listed.stdout
    data = json.loads(invoke("cache", "--json").stdout)
    assert data["folder"] == str(cache / "models") and data["bytes"] == entry.bytes > 0
    assert data["entries"][0]["path"] == str(entry.path) and data["entries"][0]["problem"] is None
    assert data["entries"][0]["variant"]["dtype"] == "float32"
    cleared = invoke("cache", "clear")
    assert cleared.exit_code == 0 and "removed 1 cached model" in cleared.stdout
    assert modelcache.entries() == [] and not entry.path.exists()

