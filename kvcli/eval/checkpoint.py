"""Checkpoints of one long stream: the whole engine state saved atomically, and continued exactly.

A checkpoint is one file, ``state.pt`` in the checkpoint folder, sealed and replaced at once
(:mod:`kvcli.io.statefile`: data only, a checksum, written beside it and renamed), so a kill at any
moment leaves the previous checkpoint or the new one. It holds:

* the cache as a saved read holds it (:mod:`kvcli.kv.snapshot`): every layer's attributes as they are (keys
  stored at their entry rotation, values, entry positions, stream indices, per-token method state,
  ``CompressedLayer.method_state``, what a layer subclass adds, such as PoD's proximal keys, and a quantized
  cache's packed stores as their tensors), and the cache's stream counters;
* the totals (token counter, NLL sum, blocks), the last hidden state that scores the next block's
  first token, and the reader offset: how many tokens of the stream were read;
* the content read: the SHA-256 of those tokens' ids (:class:`TokenDigest`).

Resuming re-tokenizes the source, hashes the tokens already read and compares them with the
checkpoint's before running anything (tokenizing is cheap next to the model, and exact where a byte
offset into incremental tokenization would not be). The same text resumes whatever path or pipe
brings it; other text (a changed file, another stdin) is refused with one line. Then the same blocks
run as in an uninterrupted run: on the CPU the totals come out identical.

Checkpoints fall on block boundaries that every run of the stream passes through: a multiple of the
block, or the source's end. The short last block a ``--max-tokens`` limit cuts off is never saved;
the state before it is, so a finished run extended to more tokens equals the uninterrupted longer
run. A checkpoint with more tokens than a resumed run's ``--max-tokens`` is refused: its numbers
cannot be taken back.

A checkpoint names what it was made with (:func:`identity`): the model by the SHA-256 of its files
(weights, config and tokenizer: :func:`fingerprint`), the torch and transformers releases, the method and
its parameters, budget, block, dtype and the cache's packing (``--kv-bits``, key mode). A resume that differs in
any of them is refused with one line saying what differs, rather than continued into a meaningless number; the
same files named another way (a relative path, a trailing slash) resume. A folder is one run's at a time
(:func:`kvcli.io.outputs.lock_folder`), and a run without ``--resume`` never overwrites a checkpoint unless told
to (:func:`claim`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from kvcli.engine.engine import BlockStats, Engine, StreamState, StreamTotals
from kvcli.errors import KvcliError, UsageError
from kvcli.io.outputs import check_output
from kvcli.io.statefile import load_state, save_state
from kvcli.kv.snapshot import SnapshotError, restore_cache, snapshot_cache
from kvcli.models.fingerprint import fingerprint, library_versions, model_difference

FILE = "state.pt"
#: 4: the cache as a snapshot (kvcli.kv.snapshot), quantized caches too (3: the layers' attributes, 16 bits only;
#: 2: the model's name; 1: no content hash)
FORMAT = 4


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--checkpoint-every``: ``N`` tokens, or ``Ns``/``Nm``/``Nh`` of wall time; (tokens, seconds)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--checkpoint-every {text!r}: expected tokens (100000) or a time (90s, 10m, 1h)")
    value, unit = float(match.group(1)), match.group(2)
    if not unit:
        return int(value), None
    return None, value * {"s": 1, "m": 60, "h": 3600}[unit]


def identity(loaded, engine: Engine) -> dict:
    """What a checkpoint is only valid for: the model's files, the libraries that compute with them, method and
    its parameters, budget, block, dtype, and how the cache is packed (bits, key mode). ``name`` (the model as
    typed) is kept for people and never compared.

    Neither the model nor the source is named by its path (a path can be spelled many ways, stdin has none):
    the model by :func:`fingerprint`, the source by a hash of the tokens read, checked when resuming.
    """
    return {"name": loaded.name, "model": fingerprint(loaded.name), "libraries": library_versions(),
            "method": engine.method.name, "params": engine.method.settings(), "budget": engine.budget,
            "block": engine.block, "dtype": str(loaded.dtype), "kv_bits": engine.kv_bits,
            "kv_keys": engine.cache_key_mode}


def difference(key: str, saved, current) -> str:
    """One clause saying how a checkpoint's identity ``saved`` differs from this run's ``current`` at ``key``."""
    if key == "model" and (clause := model_difference(saved, current, "the checkpoint")):
        return clause
    if key == "libraries" and isinstance(saved, dict):
        changed = [name for name in current if saved.get(name) != current[name]]
        if changed:
            return "it was made with " + ", ".join(f"{name} {saved.get(name)}, this run has {current[name]}"
                                                   for name in changed)
    return f"it was made with {key} {saved!r}, not this run's {current!r}"


def claim(folder: Path, resume: bool, overwrite: bool) -> Path:
    """Check, before any model loads, that ``folder`` may take this run's checkpoints.

    ``resume`` needs a checkpoint there; a run that does not resume refuses a folder holding one unless
    ``overwrite`` says to start over, so that no run silently replaces another's hours of work.
    """
    folder = check_output(folder, "--checkpoint", folder=True)
    held = (folder / FILE).exists()
    if resume and overwrite:
        raise UsageError("--resume continues the checkpoint and --overwrite replaces it: choose one")
    if resume and not held:
        raise KvcliError(f"--checkpoint {folder}: no checkpoint to resume ({FILE} is missing)")
    if held and not resume and not overwrite:
        raise UsageError(f"--checkpoint {folder} holds a checkpoint: add --resume to continue it, --overwrite to "
                         "start over, or choose another folder")
    return folder


class TokenDigest:
    """The token lists of a stream, passed on as they are read, with a SHA-256 of the ids up to any position.

    The hash covers ids as little-endian int32, in stream order (what :func:`kvcli.eval.kl.token_digest`
    hashes too). Tokens read but not yet hashed wait in a queue, so :meth:`digest` can give the hash of
    exactly the tokens a checkpoint covers while the reader is a block or a chunk ahead; the owner
    calls :meth:`advance` after every block, so the queue never holds more than that read-ahead.
    """

    def __init__(self, chunks: Iterable[list[int]]):
        self.source = iter(chunks)
        self.hash = hashlib.sha256()
        self.hashed = 0  # tokens in self.hash
        self.read = 0  # tokens taken from the source
        self.pending: deque[list[int]] = deque()  # tokens read, not hashed yet, in order

    def __iter__(self) -> Iterator[list[int]]:
        for ids in list(self.pending):  # read by skip() after the skipped tokens: not given out yet
            yield ids
        for ids in self.source:
            self.pending.append(ids)
            self.read += len(ids)
            yield ids

    def advance(self, position: int) -> None:
        """Hash the tokens up to ``position`` (read already; positions only move forward)."""
        while self.hashed < position:
            ids = self.pending.popleft()
            take = min(len(ids), position - self.hashed)
            self.hash.update(np.asarray(ids[:take], dtype="<i4").tobytes())
            self.hashed += take
            if take < len(ids):
                self.pending.appendleft(ids[take:])

    def digest(self, position: int) -> str:
        """SHA-256 of the first ``position`` tokens (all read already; positions only move forward)."""
        self.advance(position)
        return self.hash.hexdigest()

    def skip(self, count: int) -> bool:
        """Read and hash the first ``count`` tokens without giving them out; False if the source has fewer."""
        while self.read < count:
            ids = next(self.source, None)
            if ids is None:
                return False
            self.pending.append(ids)
            self.read += len(ids)
        self.advance(count)
        return True


class Checkpointer:
    """Saves a stream's state into ``folder`` every ``every_tokens`` tokens or ``every_seconds`` seconds.

    :meth:`begin` starts (or, with ``resume``, continues) the stream; the engine then calls
    :meth:`on_state` after every block, and :meth:`finish` saves the state at the end. This class is the
    policy (when to save, what a resume must match); what the file holds is the codec's (:func:`encode`,
    :func:`decode`).
    """

    def __init__(self, folder: Path, ident: dict, every_tokens: int | None, every_seconds: float | None,
                 resume: bool = False):
        self.folder = check_output(folder, "--checkpoint", folder=True)
        self.path = self.folder / FILE
        self.ident = ident
        self.every_tokens = every_tokens
        self.every_seconds = every_seconds
        self.resume = resume
        self.saved_at = (0, time.perf_counter())
        self.last: StreamState | None = None
        self.resumed_from: int | None = None  # the reader offset of the checkpoint this run continued
        self.digest: TokenDigest | None = None
        self.block = int(ident["block"])
        self.limit: int | None = None

    def begin(self, engine: Engine, tokens: Iterable[list[int]], limit: int | None
              ) -> tuple[StreamState | None, Iterator[list[int]]]:
        """The state to continue from (None: a fresh stream) and the tokens still to run.

        ``limit`` is how many tokens the run reads at most (``--max-tokens`` + 1). When resuming, the
        checkpoint's tokens are read again and hashed before anything runs: a source whose first tokens
        differ from the checkpoint's, or that has fewer, is refused with one line.
        """
        self.limit = limit
        self.digest = TokenDigest(tokens)
        if not self.resume:
            return None, iter(self.digest)
        state, content = self.load(engine)
        position = state.position
        if limit is not None and position > limit:
            raise KvcliError(f"--checkpoint {self.folder} has scored {position - 1:,} tokens, more than --max-tokens "
                             f"{limit - 1:,}: ask for at least {position - 1:,}, or start over with --overwrite")
        if not self.digest.skip(position):
            raise KvcliError(f"--checkpoint {self.folder} read {position:,} tokens, but this source has only "
                             f"{self.digest.read:,}: it is another text than the checkpoint's (use its source, or "
                             "start over with --overwrite)")
        if self.digest.hash.hexdigest() != content:
            raise KvcliError(f"--checkpoint {self.folder} was made from other text: the first {position:,} tokens of "
                             "this source differ from those it read (use the same content, by any path or on stdin, "
                             "or start over with --overwrite)")
        self.resumed_from = position
        self.saved_at = (position, time.perf_counter())
        return state, iter(self.digest)

    def _cut_short(self, position: int) -> bool:
        """Whether ``position`` ends a last block that ``--max-tokens`` cut short: a state no longer run has."""
        return position % self.block != 0 and self.limit is not None and position >= self.limit

    def on_state(self, state: StreamState) -> None:
        """After every block: save when enough tokens or time have passed since the last save, and always at
        the last whole block before a ``--max-tokens`` cut (what extending the run continues from)."""
        self.last = state
        position = state.position
        self.digest.advance(position)  # hashed block by block: memory stays flat between saves
        tokens, when = self.saved_at
        if position == tokens or self._cut_short(position):
            return
        boundary = None if self.limit is None else self.limit - self.limit % self.block
        if (position == boundary or (self.every_tokens is not None and position - tokens >= self.every_tokens)
                or (self.every_seconds is not None and time.perf_counter() - when >= self.every_seconds)):
            self.save(state)

    def finish(self) -> None:
        """Save the final state of a stream that ran to its end (resuming it then just reports), unless it is
        the short block a ``--max-tokens`` limit cut off: the state before that one is saved already."""
        if self.last is not None and self.saved_at[0] != self.last.position and not self._cut_short(self.last.position):
            self.save(self.last)

    def save(self, state: StreamState) -> None:
        """Replace the checkpoint with ``state`` (:func:`encode`), sealed and renamed at once."""
        content = self.digest.digest(state.position) if self.digest is not None else None
        save_state(self.path, encode(state, self.ident, content))
        self.saved_at = (state.position, time.perf_counter())

    def load(self, engine: Engine) -> tuple[StreamState, str]:
        """The saved state, on ``engine``'s device, and the hash of the tokens it read, after checking it was
        made with the same settings. Whatever is not a whole checkpoint of this format is one line."""
        if not self.path.is_file():
            raise KvcliError(f"--checkpoint {self.folder}: no checkpoint to resume ({FILE} is missing)")
        advice = "start over with --overwrite, or use another folder"
        payload = load_state(self.path, "kvcli checkpoint", advice)
        if payload.get("format") != FORMAT:
            raise KvcliError(f"--checkpoint {self.folder}: {FILE} is not a kvcli checkpoint of format {FORMAT}: "
                             f"{advice}")
        saved = payload.get("identity")
        if not isinstance(saved, dict):
            raise KvcliError(f"--checkpoint {self.folder}: {FILE} is damaged (no identity): {advice}")
        for key, value in self.ident.items():
            if key != "name" and saved.get(key) != value:
                raise KvcliError(f"--checkpoint {self.folder}: {difference(key, saved.get(key), value)}; resume with "
                                 "the same model, libraries, method, budget, block, dtype and --kv-bits, or use "
                                 "another folder")
        try:
            state, content = decode(payload, engine)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
            what = f"{exc.args[0]!r} is missing" if isinstance(exc, KeyError) else f"{type(exc).__name__}"
            raise KvcliError(f"--checkpoint {self.folder}: {FILE} is damaged ({what}): {advice}") from None
        return state, content


# --- the codec: a stream's state as a checkpoint's data, and back -------------------------------------------------


#: What a checkpoint may hold: what ``torch.load(weights_only=True)`` gives back (kvcli.io.statefile).
_DATA = (torch.Tensor, torch.dtype, torch.device, str, int, float, bool, type(None))


def _check_data(value, where: str) -> None:
    """Raise unless ``value`` is data the safe loader restores: a state holding an object (packed keys of a
    quantized cache, a layer added by a new method) is refused when saved, not written to be refused on resume."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_data(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_data(item, f"{where}[{index}]")
    elif not isinstance(value, _DATA):
        raise KvcliError(f"cannot checkpoint {where}: a {type(value).__name__} is not data a checkpoint restores "
                         "(tensors, dtypes, numbers, strings)")


def encode(state: StreamState, ident: dict, content: str | None) -> dict:
    """The checkpoint of ``state``, made with ``ident`` (:func:`identity`) from the tokens whose hash is ``content``:
    data only, on the CPU; a state holding anything else is refused here (:func:`_check_data`)."""
    try:
        tensors, facts = snapshot_cache(state.cache)
    except SnapshotError as exc:
        raise KvcliError(f"cannot checkpoint the cache: {exc}") from None
    payload = {
        "format": FORMAT, "identity": ident, "position": state.position, "content": content,
        "previous": state.previous.detach().to("cpu").clone(), "totals": dataclasses.asdict(state.totals),
        "cache": {"tensors": tensors, "facts": facts},
    }
    _check_data(payload, "checkpoint")
    return payload


def decode(payload: dict, engine: Engine) -> tuple[StreamState, str]:
    """The stream state a checkpoint holds, on ``engine``'s device, and the hash of the tokens it read.

    Any key missing, of the wrong type or of the wrong shape raises (KeyError, TypeError, ValueError and the
    like; a snapshot that does not fit the cache is a ValueError): the caller words that as a damaged checkpoint."""
    position, content = payload["position"], payload["content"]
    if not isinstance(position, int) or position < 1 or not isinstance(content, str):
        raise ValueError("position or content")
    saved = payload["cache"]
    tensors = saved["tensors"]
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise TypeError("cache tensors")
    cache = restore_cache(engine.new_cache(), tensors, saved["facts"], engine.device)
    totals = _decode_totals(dict(payload["totals"]), position)
    previous = payload["previous"]
    if not isinstance(previous, torch.Tensor) or previous.dim() != 2:
        raise TypeError("previous")
    return StreamState(cache, totals, previous.to(engine.device), position), content


def _decode_totals(saved: dict, position: int) -> StreamTotals:
    """The saved totals of a stream that has read ``position`` tokens."""
    if set(saved) != {field.name for field in dataclasses.fields(StreamTotals)}:
        raise KeyError("totals." + ",".join(sorted({f.name for f in dataclasses.fields(StreamTotals)} ^ set(saved))))
    blocks = [BlockStats(**block) for block in saved.pop("blocks")]
    totals = StreamTotals(**saved, blocks=blocks)
    # A stream scores every token but its first exactly once, block by block: totals that say otherwise
    # were not written by this module.
    if (totals.tokens != position - 1 or totals.processed != position
            or sum(block.tokens for block in blocks) != totals.tokens
            or not all(isinstance(getattr(totals, name), int | float) for name in saved)):
        raise ValueError("totals")
    return totals
