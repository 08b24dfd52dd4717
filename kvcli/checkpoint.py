"""Checkpoints of one long stream: the whole engine state saved atomically, and continued exactly.

A checkpoint is one file, ``state.pt`` in the checkpoint folder, replaced at once (written beside it,
then renamed: :func:`kvcli.outputs.atomic_write`), so a kill at any moment leaves the previous
checkpoint or the new one. It holds:

* every cache layer's attributes as they are (keys stored at their entry rotation, values, entry
  positions, stream indices, per-token method state, ``CompressedLayer.method_state``, and what a
  layer subclass adds, such as PoD's proximal keys), and the cache's stream counters;
* the totals (token counter, NLL sum, blocks), the last hidden state that scores the next block's
  first token, and the reader offset: how many tokens of the stream were read.

Resuming re-tokenizes the source and skips the tokens already read (tokenizing is cheap next to the
model, and exact where a byte offset into incremental tokenization would not be), then runs the same
blocks as an uninterrupted run: on the CPU the totals come out identical. Checkpoints are taken at
block boundaries only; Ctrl-C or a kill between two checkpoints loses the blocks since the last one.

A checkpoint names what it was made with (:func:`identity`): another model, method, budget, block,
dtype or source is refused with one line rather than continued into a meaningless number.
"""

from __future__ import annotations

import dataclasses
import io
import re
import time
from pathlib import Path

import torch

from kvcli.engine import BlockStats, Engine, StreamState, StreamTotals
from kvcli.errors import KvcliError, UsageError
from kvcli.outputs import atomic_write, check_output

FILE = "state.pt"
FORMAT = 1
_SKIP = ("owner", "record")  # a layer's back-reference and its transient attention record


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--checkpoint-every``: ``N`` tokens, or ``Ns``/``Nm``/``Nh`` of wall time; (tokens, seconds)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--checkpoint-every {text!r}: expected tokens (100000) or a time (90s, 10m, 1h)")
    value, unit = float(match.group(1)), match.group(2)
    if not unit:
        return int(value), None
    return None, value * {"s": 1, "m": 60, "h": 3600}[unit]


def identity(loaded, engine: Engine, documents: list) -> dict:
    """What a checkpoint is only valid for: model, method and its parameters, budget, block, dtype, source."""
    return {"model": loaded.name, "method": engine.method.name, "params": engine.method.settings(),
            "budget": engine.budget, "block": engine.block, "dtype": str(loaded.dtype),
            "source": [[doc.name, doc.size] for doc in documents]}


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu(v) for v in value)
    if isinstance(value, torch.device):
        return str(value)
    return value


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value


class Checkpointer:
    """Saves a stream's state into ``folder`` every ``every_tokens`` tokens or ``every_seconds`` seconds."""

    def __init__(self, folder: Path, ident: dict, every_tokens: int | None, every_seconds: float | None):
        self.folder = check_output(folder, "--checkpoint", folder=True)
        self.path = self.folder / FILE
        self.ident = ident
        self.every_tokens = every_tokens
        self.every_seconds = every_seconds
        self.saved_at = (0, time.perf_counter())
        self.last: StreamState | None = None
        self.resumed_from: int | None = None  # the reader offset of the checkpoint this run continued

    def on_state(self, state: StreamState) -> None:
        """After every block: save when enough tokens or time have passed since the last save."""
        self.last = state
        tokens, when = self.saved_at
        if (self.every_tokens is not None and state.position - tokens >= self.every_tokens) or (
                self.every_seconds is not None and time.perf_counter() - when >= self.every_seconds):
            self.save(state)

    def finish(self) -> None:
        """Save the final state of a stream read to its end (resuming it then just reports)."""
        if self.last is not None and self.saved_at[0] != self.last.position:
            self.save(self.last)

    def save(self, state: StreamState) -> None:
        cache = state.cache
        totals = dataclasses.asdict(state.totals)
        payload = {
            "format": FORMAT, "identity": self.ident, "position": state.position,
            "previous": _cpu(state.previous), "totals": totals,
            "cache": {"block_start": cache.block_start, "stream_start": cache.stream_start,
                      "keep_positions": cache.keep_positions,
                      "layers": [{k: _cpu(v) for k, v in vars(layer).items() if k not in _SKIP}
                                 for layer in cache.layers]},
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        atomic_write(self.path, buffer.getvalue())
        self.saved_at = (state.position, time.perf_counter())

    def load(self, engine: Engine) -> StreamState:
        """The saved state, on ``engine``'s device, after checking it was made with the same settings."""
        if not self.path.is_file():
            raise KvcliError(f"--checkpoint {self.folder}: no checkpoint to resume ({FILE} is missing)")
        try:
            payload = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line answer
            raise KvcliError(f"--checkpoint {self.folder}: {FILE} is not a readable kvcli checkpoint "
                             f"({type(exc).__name__})") from None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise KvcliError(f"--checkpoint {self.folder}: {FILE} is not a kvcli checkpoint of format {FORMAT}")
        saved = payload["identity"]
        for key, value in self.ident.items():
            if saved.get(key) != value:
                shown = "the source" if key == "source" else f"{key} {saved.get(key)!r}"
                raise KvcliError(f"--checkpoint {self.folder} was made with {shown}, not this run's: resume with "
                                 "the same model, method, budget, block, dtype and source, or use another folder")
        device = engine.device
        cache = engine.new_cache()
        saved_cache = payload["cache"]
        cache.block_start = saved_cache["block_start"]
        cache.stream_start = saved_cache["stream_start"]
        cache.keep_positions = saved_cache["keep_positions"]
        for layer, attributes in zip(cache.layers, saved_cache["layers"], strict=True):
            for key, value in attributes.items():
                setattr(layer, key, _to(value, device))
            layer.device = device
        totals_dict = dict(payload["totals"])
        blocks = [BlockStats(**block) for block in totals_dict.pop("blocks")]
        totals = StreamTotals(**totals_dict, blocks=blocks)
        previous = payload["previous"]
        self.resumed_from = payload["position"]
        self.saved_at = (payload["position"], time.perf_counter())
        return StreamState(cache, totals, None if previous is None else previous.to(device), payload["position"])


def skip_tokens(chunks, count: int):
    """The token lists of ``chunks`` after the first ``count`` tokens (a resumed stream's reader)."""
    for ids in chunks:
        if count >= len(ids):
            count -= len(ids)
            continue
        yield ids[count:]
        count = 0
