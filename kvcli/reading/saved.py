"""A read saved to a file, so that one read of a book answers many questions (``kvcli read``, ``kvcli ask BOOK.kvc``).

A read without a question (:meth:`kvcli.reading.reader.Reader.read_state`) streams ``prefix + document`` in
blocks, compressing after each, and stops before the document's last tokens (at most one block): those go
through the model with each question, as the last block of a streamed ``ask`` does. :class:`ReadState` is
that cache and those tokens, in memory or in a file.

The file is safetensors (tensors by name, and a JSON header; nothing in it is ever unpickled or run): the
cache's tensors (:mod:`kvcli.kv.snapshot`) and, in the header's metadata under ``kvcli-read``, what the read is
valid for: the model by the SHA-256 of its files (:func:`kvcli.models.fingerprint.fingerprint`), never by its
name; the method, its parameters, budget, block, ``--kv-bits`` and dtype; the tokens read (their hash and count);
kvcli's version. The SHA-256 of the tensor data is in the header too, so a file cut short or altered is refused
rather than answered from. A state is written at once (:func:`kvcli.io.outputs.atomic_write`): a kill leaves the
old file or the new one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvcli.errors import KvcliError
from kvcli.io.outputs import atomic_write
from kvcli.io.tensorfile import TensorFile, TensorFileError, file_parts
from kvcli.kv.quant import nbytes
from kvcli.kv.snapshot import SnapshotError, restore_cache, snapshot_cache
from kvcli.reading.generate import Generation
from kvcli.reading.keystore import KeyStore
from kvcli.reading.prompts import PromptParts, build_prompt, question_instruction
from kvcli.reading.recall import KIND as RECALL_KIND
from kvcli.reading.recall import PageIndex, select
from kvcli.reading.recap import RECALL_TOKENS

__all__ = ["FORMAT", "SUFFIX", "ReadState", "answer", "identity_difference", "is_saved_read", "prompt_parts",
           "read_identity", "read_once"]

#: The header's name for the format, and its version (bumped whenever an older file could be misread).
FORMAT, VERSION = "kvcli-read", 3
#: The file name ending ``kvcli read --out`` suggests and ``kvcli ask`` recognises a saved read by.
SUFFIX = ".kvc"
#: Longest JSON header a saved read may have (the cache's facts are a few hundred bytes per layer).
MAX_HEADER = 64 << 20


@dataclass
class ReadState:
    """A document read without a question: the compressed cache (as a snapshot, so every question starts from the
    same state), the document's last ``pending`` tokens that go through with each question, and what made it."""

    tensors: dict[str, torch.Tensor]
    facts: dict
    prefix: list[int]  # the prompt's start (chat template) the read began with; every question's must match
    pending: list[int]  # the document's last tokens, read with the question (at most one block)
    read_tokens: int  # prompt tokens already in the cache (the prefix and the document but ``pending``)
    document_tokens: int
    max_cache_tokens: int
    read_seconds: float
    identity: dict = field(default_factory=dict)  # model, method, budget, block, kv_bits, dtype, source
    #: The read's index for recall (:class:`kvcli.reading.recall.PageIndex`): its keys on disk (None: none kept),
    #: every token's id and its facts.
    recall_keys: KeyStore | None = None
    recall_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    recall_facts: dict = field(default_factory=dict)

    def cache(self, engine):
        """A fresh cache of ``engine`` holding this read (each question gets its own; the snapshot is not touched)."""
        try:
            return restore_cache(engine.new_cache(), self.tensors, self.facts, engine.device)
        except (SnapshotError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise KvcliError(f"the saved read does not fit this cache ({exc}): read the book again") from None

    # --- the file -------------------------------------------------------------------------------------------------
    def recall_bytes(self) -> int:
        """Bytes of the recall index (every token's keys, scales and ids): it grows with the document, on disk and
        in the file, where the cache does not."""
        return (self.recall_keys.nbytes if self.recall_keys else 0) + nbytes(self.recall_ids)

    def can_recall(self) -> bool:
        """Whether the read kept an index this kvcli recalls from (not a nested read, not an older file's)."""
        return (self.recall_keys is not None and bool(self.recall_facts.get("usable"))
                and self.recall_facts.get("kind") == RECALL_KIND)

    def save(self, path: Path) -> int:
        """Write the state to ``path`` at once; return the file's size in bytes. The data is written tensor by
        tensor, the recall index a layer and head at a time from its spill, never joined in memory
        (:func:`kvcli.io.tensorfile.file_parts`)."""
        header = {"format": FORMAT, "version": VERSION, "identity": self.identity, "cache": self.facts,
                  "prefix": self.prefix, "pending": self.pending, "read_tokens": self.read_tokens,
                  "document_tokens": self.document_tokens, "max_cache_tokens": self.max_cache_tokens,
                  "read_seconds": self.read_seconds, "recall": self.recall_facts}
        recall: dict = {"recall.ids": self.recall_ids}
        if self.recall_keys is not None:
            recall["recall.keys"], recall["recall.scales"] = self.recall_keys.streamed()
        parts, _ = file_parts({**self.tensors, **recall}, {FORMAT: json.dumps(header, default=str)}, sealed=FORMAT)
        atomic_write(Path(path), parts)
        return Path(path).stat().st_size

    @classmethod
    def load(cls, path: Path) -> ReadState:
        """The state saved at ``path``; whatever is not a whole saved read of this version is one line. The cache
        is read into memory; the recall index stays in the file, which is kept open, and is read a range at a time
        (:class:`kvcli.reading.keystore.KeyStore`)."""
        file = _open(Path(path))
        header = _header(file, path)
        try:
            if header.get("data_sha256") != file.sha256():
                raise KvcliError(f"{path} is a damaged saved read (its checksum does not match: cut short or altered): "
                                 "read the book again")
            tensors = {name: file.load(name) for name in file.entries if not name.startswith("recall.")}
            recall = dict(header.get("recall") or {})
            ids = file.load("recall.ids") if "recall.ids" in file.entries else torch.zeros(0, dtype=torch.int32)
            return cls(tensors, dict(header["cache"]), _ids(header["prefix"]), _ids(header["pending"]),
                       _count(header["read_tokens"]), _count(header["document_tokens"]),
                       _count(header["max_cache_tokens"]), float(header["read_seconds"]), dict(header["identity"]),
                       _keys(file, recall, ids), ids, recall)
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise KvcliError(f"{path} is a damaged saved read ({type(exc).__name__}: {exc}): read the book again"
                             ) from None

    def check(self, current: dict, path: Path) -> None:
        """Refuse, with one line, to answer from a read made with another model, dtype or kvcli format."""
        for key in ("model", "dtype"):
            if self.identity.get(key) != current.get(key):
                clause = identity_difference(key, self.identity.get(key), current.get(key))
                raise KvcliError(f"{path} cannot be answered here: {clause}")


def can_recall(reader, state: ReadState) -> bool:
    """Whether ``state`` can be recalled from on ``reader``: its index is usable and the method's cache takes the
    probe that gives the question's queries (:meth:`kvcli.methods.base.Method.probes`)."""
    return state.can_recall() and reader.engine.method.probes()


def recalled(reader, state: ReadState, cache, parts: PromptParts, tokens: int) -> list[int]:
    """The ids of the pages of ``state`` the question of ``parts`` points at, at most ``tokens``."""
    if not can_recall(reader, state):
        raise KvcliError("this read has no recall index this kvcli can use (a read that nests its layers, "
                         "pyramidinfer; a method whose cache takes no probe, pod; or a file of an older kvcli): ask "
                         "without --recall, or read the book again")
    return select(reader.engine, cache, state.recall_keys, state.recall_ids, state.recall_facts, parts.suffix,
                  parts.question_span, tokens, len(state.prefix))


def identity_difference(key: str, saved, current) -> str:
    """One clause saying how a saved read's ``saved`` identity differs from this run's ``current`` at ``key``."""
    from kvcli.models.fingerprint import model_difference

    if key == "model" and (clause := model_difference(saved, current, "the saved read")):
        return clause + ": read the book again with this model"
    return f"it was read with {key} {saved!r}, this run has {current!r}"


def is_saved_read(source: str) -> bool:
    """Whether ``source`` names a saved read: a file ending in :data:`SUFFIX` (its content is checked on loading)."""
    return source.endswith(SUFFIX) and Path(source).is_file()


def _open(path: Path) -> TensorFile:
    """``path`` opened as a safetensors file (its header read), or one line saying why not."""
    try:
        stream = path.open("rb")
    except OSError as exc:
        raise KvcliError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return TensorFile(stream, MAX_HEADER)
    except (TensorFileError, OSError):
        stream.close()
        raise KvcliError(f"{path} is not a saved read (not a safetensors file, or cut short): read the book with "
                         "`kvcli read SOURCE --out FILE.kvc`") from None


def _header(file: TensorFile, path: Path) -> dict:
    """The ``kvcli-read`` header of ``file``, or one line saying why it is not a saved read of this version."""
    try:
        header = json.loads(file.metadata.get(FORMAT, "null"))
    except (ValueError, AttributeError, TypeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise KvcliError(f"{path} is not a saved read of kvcli (no {FORMAT} header)")
    if header.get("version") != VERSION:
        raise KvcliError(f"{path} is a saved read of format version {header.get('version')!r}; this kvcli reads "
                         f"version {VERSION}: read the book again")
    return header


def _keys(file: TensorFile, facts: dict, ids: torch.Tensor) -> KeyStore | None:
    """The recall index's keys in ``file`` where ``facts`` say the read kept a usable one, checked to hold the
    layers, heads and dim the facts name for every token of ``ids``."""
    if not facts.get("usable") or facts.get("kind") != RECALL_KIND:
        return None
    layers, heads, dim = len(facts["layers"]), _count(facts["heads"]), _count(facts["dim"])
    keys, scales = file.entries["recall.keys"], file.entries["recall.scales"]
    tokens = ids.shape[0]
    if keys.shape != [layers, heads, tokens, dim] or keys.dtype != torch.int8 or \
            scales.shape != [layers, heads, tokens] or scales.dtype != torch.float16:
        raise ValueError("the recall index does not hold what its facts say")
    return KeyStore.in_file(file.stream, layers, heads, dim, tokens, keys.begin, scales.begin)


def _ids(value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0
                                              for item in value):
        raise TypeError("token ids")
    return value


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError("a count")
    return value


def read_identity(loaded, engine) -> dict:
    """What a read by ``engine`` on ``loaded`` (:func:`kvcli.models.load.load_model`'s result) is valid for and was
    made with: the model by its files' fingerprint (its name kept to load it again), dtype, the libraries and kvcli's
    release, the method, its parameters, budget, block and bits."""
    from importlib.metadata import PackageNotFoundError, version

    from kvcli.models.fingerprint import fingerprint, library_versions

    try:
        release = version("kvcli")
    except PackageNotFoundError:
        release = "unknown"
    method = engine.method
    return {"name": loaded.name, "model": fingerprint(loaded.name), "dtype": str(loaded.dtype),
            "libraries": library_versions(), "kvcli": release, "method": method.name, "params": method.settings(),
            "budget": engine.budget, "block": engine.block, "kv_bits": engine.kv_bits, "kv_keys": engine.kv_keys}


def prompt_parts(tokenizer, question: str, answer_prefix: str = "", frame: bool = True) -> PromptParts:
    """The prompt around the document for ``question`` as ``ask`` builds it (its start is every question's)."""
    return build_prompt(tokenizer, question_instruction(question or "?", answer_prefix, frame=frame))


def read_once(reader, document: Iterable[list[int]], identity: dict | None = None,
              spill: Path | None = None) -> ReadState:
    """Read ``document`` (chunks of token ids, :func:`kvcli.reading.reader.document_tokens`) with ``reader`` without a
    question (no probe, no recap: the question is not known yet), every whole block but the last into the cache,
    after the prompt's start. ``identity`` (:func:`read_identity`: what the read is valid for) goes with it, the
    SHA-256 and count of the document's tokens added under ``source``. ``spill``: the folder of the recall index's
    temporary file (None: the system's temporary folder; a saved read's own folder keeps it on the disk it goes
    to)."""
    started = time.perf_counter()
    result = Generation()
    cache = reader.engine.new_cache()
    digest = hashlib.sha256()

    def hashed() -> Iterator[list[int]]:
        for chunk in document:
            digest.update(np.asarray(chunk, dtype="<i4").tobytes())
            yield chunk

    prefix = prompt_parts(reader.tokenizer, "").prefix
    pending = list(prefix)
    index = PageIndex.for_model(reader.engine.model, reader.engine.architecture.windows, spill)
    with index.recording(reader.engine.decoder):
        read = reader.read_blocks(cache, pending, hashed(), result, started, after=index.add)
    tokens = read + len(pending) - len(prefix)
    if tokens == 0:
        raise KvcliError("the document is empty: nothing to read")
    tensors, facts = snapshot_cache(cache)
    source = {"tokens": tokens, "tokens_sha256": digest.hexdigest()}
    return ReadState(tensors, facts, list(prefix), pending, read, tokens, result.max_cache_tokens,
                     time.perf_counter() - started, {**(identity or {}), "source": source},
                     index.store if index.usable else None, index.token_ids(), index.facts())


def answer(reader, state: ReadState, question: str | PromptParts, max_new_tokens: int = 128,
           on_text: Callable[[str], None] | None = None, recall: int | None = None) -> Generation:
    """Answer ``question`` (framed as ``ask`` frames it, or the prompt :func:`prompt_parts` built) from ``state``: a
    fresh copy of its cache, the document's last tokens and the question read as the last block of a streamed
    ``ask`` without a probe, then the answer written. ``recall``: first read again at most this many tokens of the
    pages the question points at (:mod:`kvcli.reading.recall`), after the document and before the question, in the
    question's block (the document's tail is read first when all three would not fit one); 0:
    none, so the answer is a fresh ``ask --no-probe --no-one-shot``'s; None: :data:`RECALL_TOKENS` where the read
    kept its index, else none. Nothing in ``state`` changes, so every question of a read starts from the same
    cache."""
    if recall is None:
        recall = RECALL_TOKENS if can_recall(reader, state) else 0
    parts = prompt_parts(reader.tokenizer, question) if isinstance(question, str) else question
    if list(parts.prefix) != state.prefix:
        raise KvcliError("the saved read began with another prompt start (chat template) than this question's: read "
                         "the book again with this model and template")
    started = time.perf_counter()
    result = Generation(max_cache_tokens=state.max_cache_tokens)
    cache = state.cache(reader.engine)
    pending, read, held = list(state.pending), state.read_tokens, len(parts.suffix)
    if recall > 0 and (again := recalled(reader, state, cache, parts, recall)):
        read, last = reader.read_again(cache, pending, again, result, started, read, whole=True)
        held += last
    hidden = reader.finish(cache, pending, parts, result, read, state.document_tokens, held, started)
    result.read_seconds = time.perf_counter() - started
    reader.write(cache, hidden[-1:], result, max_new_tokens, on_text)
    return result
