"""KL divergence against a reference run: ``kvcli ppl --save-logits FILE`` and ``--kl-base FILE``.

Perplexity averages away where a compressed cache changes the model's predictions; the KL
divergence from a reference run (``full`` within the trained context, or a large cache beyond it)
token by token does not (llama.cpp's ``--kl-divergence``, here under compression). A reference is
saved while it streams, one fixed-size record per scored token, so a stream of millions of tokens
never holds more than a block's logits:

* a header: magic, then a JSON object (model, vocabulary size, top-k);
* per scored token: its id, the ids of the reference's ``k`` most likely next tokens, their
  log-probabilities (fp16) and the log of the probability left to the other tokens (fp32);
* a footer: a JSON object (tokens, the SHA-256 of the scored token ids, the SHA-256 of all the records,
  interrupted), then magic. A file without it was cut off and is refused; a comparison that read
  every record and finds another hash (a flipped bit) is refused too, rather than reported.

The comparison coarsens both distributions to the same ``k + 1`` buckets (the reference's top-k
tokens and "the rest"), rounds the run's top-k log-probabilities to fp16 as the file holds them,
and takes KL(reference || run) over the buckets. By the data-processing inequality this is a
lower bound of the KL over the whole vocabulary, close to it when the rest is small, and exactly 0
for a run against its own reference. Each token's id is checked against the record, so a file
saved from another stream is refused at the first token that differs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from kvcli.errors import KvcliError, UsageError
from kvcli.io.outputs import remove_partial

MAGIC = b"KVCLIKL1"
END = b"KVCLIEND"
DEFAULT_TOP_K = 32
_LENGTH = struct.Struct("<I")


def record_dtype(top_k: int) -> np.dtype:
    """One scored token: its id, the reference's top-k ids and log-probabilities, the rest's log-mass."""
    return np.dtype([("target", "<i4"), ("ids", "<i4", (top_k,)), ("logp", "<f2", (top_k,)), ("rest", "<f4")])


def top_and_rest(logprobs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities at ``ids`` ``[n, k]`` as fp16 holds them, and the log of the mass of every other token."""
    top = logprobs.gather(1, ids).half().float()
    rest = torch.logsumexp(logprobs.scatter(1, ids, float("-inf")), dim=-1)
    return top, rest


def token_digest(targets) -> str:
    """SHA-256 of scored token ids as a reference's footer records them (int32, little-endian, in order)."""
    return hashlib.sha256(np.asarray(targets, dtype="<i4").tobytes()).hexdigest()


class LogitsWriter:
    """Writes a reference as the run streams: :meth:`add` per chunk of scored tokens, :meth:`close` once."""

    def __init__(self, path: Path, model: str, vocab: int, top_k: int = DEFAULT_TOP_K):
        if top_k < 1 or top_k >= vocab:
            raise UsageError(f"--logits-top-k must be between 1 and {vocab - 1} (the vocabulary), not {top_k}")
        self.path, self.top_k = Path(path), top_k
        self.dtype = record_dtype(top_k)
        self.tokens = 0
        self.digest = hashlib.sha256()
        self.records = hashlib.sha256()
        try:
            self.file: BinaryIO = self.path.open("wb")
        except OSError as err:
            raise KvcliError(f"cannot write {path}: {err.strerror}") from None
        header = json.dumps({"model": model, "vocab": vocab, "top_k": top_k}).encode()
        self.file.write(MAGIC + _LENGTH.pack(len(header)) + header)

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        """Store ``logprobs`` ``[n, V]`` (log-softmax over the vocabulary) of the tokens ``targets`` ``[n]``."""
        ids = logprobs.topk(self.top_k, dim=-1).indices
        top, rest = top_and_rest(logprobs, ids)
        records = np.empty(targets.shape[0], dtype=self.dtype)
        records["target"] = targets.cpu().numpy()
        records["ids"] = ids.cpu().numpy()
        records["logp"] = top.cpu().numpy()
        records["rest"] = rest.cpu().numpy()
        data = records.tobytes()
        self.file.write(data)
        self.records.update(data)
        self.digest.update(records["target"].tobytes())
        self.tokens += targets.shape[0]

    def abort(self) -> None:
        """Remove a file whose run failed, rather than leave a reference nobody can trust (a regular file only:
        ``--save-logits /dev/full`` must never delete the device)."""
        try:
            self.file.close()
        except OSError:
            pass  # its writes failed already; the file goes
        remove_partial(self.path)

    def close(self, interrupted: bool = False) -> None:
        footer = json.dumps({"tokens": self.tokens, "sha256": self.digest.hexdigest(),
                             "records_sha256": self.records.hexdigest(), "interrupted": interrupted}).encode()
        self.file.write(footer + _LENGTH.pack(len(footer)) + END)
        self.file.close()


class Reference:
    """A saved reference, read record by record in stream order."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.file: BinaryIO = self.path.open("rb")
        except OSError as err:
            raise KvcliError(f"cannot read {path}: {err.strerror}") from None
        try:
            head = self.file.read(len(MAGIC) + _LENGTH.size)
            if len(head) < len(MAGIC) + _LENGTH.size or not head.startswith(MAGIC):
                raise KvcliError(f"{path} is not a reference saved with --save-logits")
            header = json.loads(self.file.read(_LENGTH.unpack(head[len(MAGIC):])[0]))
            self.start = self.file.tell()
            self.file.seek(0, 2)
            size = self.file.tell()
            self.file.seek(size - len(END) - _LENGTH.size)
            tail = self.file.read()
            if not tail.endswith(END):
                raise KvcliError(f"{path} is incomplete (its run stopped before the end): save it again")
            length = _LENGTH.unpack(tail[:_LENGTH.size])[0]
            self.file.seek(size - len(END) - _LENGTH.size - length)
            footer = json.loads(self.file.read(length))
            self.model: str = str(header["model"])
            self.vocab: int = int(header["vocab"])
            self.top_k: int = int(header["top_k"])
            self.tokens: int = int(footer["tokens"])
            self.sha256: str = str(footer["sha256"])
            self.records_sha256: str | None = footer.get("records_sha256")  # None in files of older kvcli
            self.dtype = record_dtype(self.top_k)
            if self.top_k < 1 or self.tokens < 0 or self.start + self.tokens * self.dtype.itemsize > size:
                raise ValueError("sizes")
        except (ValueError, TypeError, KeyError, AttributeError, struct.error, OSError):
            self.file.close()
            raise KvcliError(f"{path} is not a reference saved with --save-logits") from None
        self.file.seek(self.start)
        self.read_so_far = 0
        self.records = hashlib.sha256()  # of the records read, checked against the footer's once all are

    def check_model(self, model: str, vocab: int) -> None:
        """Refuse a run of another model (its vocabulary, and so its distributions, differ)."""
        if model != self.model or vocab != self.vocab:
            raise UsageError(f"{self.path} was saved with {self.model} (vocabulary {self.vocab:,}), "
                             f"not {model} (vocabulary {vocab:,})")

    def read(self, count: int) -> np.ndarray:
        """The next ``count`` records; a stream longer than the reference is refused."""
        if self.read_so_far + count > self.tokens:
            raise KvcliError(f"the stream is longer than the {self.tokens:,} tokens of {self.path}: "
                             "compare over the same tokens (--max-tokens)")
        data = self.file.read(count * self.dtype.itemsize)
        self.read_so_far += count
        self.records.update(data)
        return np.frombuffer(data, dtype=self.dtype)

    def read_rest(self, digest) -> None:
        """Read the records the run did not compare, into the records' hash and the token ``digest``, so that the
        footer's checksums still cover the whole file when fewer tokens were asked for."""
        chunk = max(1, (1 << 24) // self.dtype.itemsize)
        while self.read_so_far < self.tokens:
            digest.update(self.read(min(chunk, self.tokens - self.read_so_far))["target"].tobytes())

    def close(self) -> None:
        self.file.close()


@dataclass
class Divergence:
    """What ``--kl-base`` reports: KL(reference || run) in nats per token, and how often the top token agrees."""

    base: str
    tokens: int
    mean: float
    p99: float
    same_top: float  # fraction of tokens whose reference top token is also the run's top token

    def as_dict(self) -> dict:
        return {"kl_base": self.base, "kl_tokens": self.tokens, "kl_mean": self.mean, "kl_p99": self.p99,
                "same_top": self.same_top}


class KLMeter:
    """Compares a run with a :class:`Reference` token by token as it streams (:meth:`add` per chunk).

    ``asked``: the tokens the run was asked to score when fewer than the reference holds (``--max-tokens``):
    a run that scores exactly that many is compared over the reference's first ``asked`` tokens.
    """

    def __init__(self, reference: Reference, asked: int | None = None):
        self.reference = reference
        self.asked = asked
        self.values = array("f")  # one float per token: the 99th percentile needs them all (4 bytes each)
        self.same = 0
        self.digest = hashlib.sha256()

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        records = self.reference.read(targets.shape[0])
        expected = torch.from_numpy(records["target"].astype(np.int64)).to(targets.device)
        differs = (expected != targets).nonzero()
        if differs.numel():
            at = len(self.values) + int(differs[0, 0])
            raise KvcliError(f"{self.reference.path} was saved from another token stream (token {at:,} differs): "
                             "compare the same source, protocol and model")
        self.digest.update(records["target"].tobytes())
        device = logprobs.device
        if records["ids"].size and not 0 <= int(records["ids"].min()) <= int(records["ids"].max()) < logprobs.shape[1]:
            raise KvcliError(f"{self.reference.path} is damaged (a token id outside the vocabulary): save it again")
        ids = torch.from_numpy(records["ids"].astype(np.int64)).to(device)
        base = torch.cat((torch.from_numpy(records["logp"].astype(np.float32)),
                          torch.from_numpy(records["rest"].copy())[:, None]), dim=1).to(device)
        top, rest = top_and_rest(logprobs, ids)
        run = torch.cat((top, rest[:, None]), dim=1)
        base, run = base.log_softmax(dim=-1), run.log_softmax(dim=-1)  # the k + 1 buckets, each summing to 1
        kl = (base.exp() * (base - run)).sum(dim=-1).clamp_min(0.0)
        self.values.extend(kl.cpu().tolist())
        self.same += int((logprobs.gather(1, ids[:, :1])[:, 0] >= logprobs.max(dim=-1).values).sum())

    def finish(self, interrupted: bool = False) -> Divergence:
        """The summary; a finished stream shorter than the reference (unless it scored the fewer tokens asked for)
        or another one of the same length is refused, an interrupted one is summarised over the tokens it compared.

        Every token compared was checked against the reference's as it came; when fewer were asked for, the rest
        of the file is read too, so that a damaged record anywhere is still refused by the footer's checksums."""
        count = len(self.values)
        ref = self.reference
        if not interrupted and self.asked is not None and count == self.asked < ref.tokens:
            ref.read_rest(self.digest)
        if not interrupted and (ref.read_so_far != ref.tokens or self.digest.hexdigest() != ref.sha256):
            raise KvcliError(f"the run scored {count:,} tokens, {ref.path} holds {ref.tokens:,}: "
                             "compare over the same tokens (source, protocol, --max-tokens)")
        if not interrupted and ref.records_sha256 is not None and ref.records.hexdigest() != ref.records_sha256:
            raise KvcliError(f"{ref.path} is damaged (its records do not match their checksum): save it again")
        values = np.frombuffer(self.values, dtype=np.float32) if count else np.zeros(1, dtype=np.float32)
        return Divergence(str(ref.path), count, float(values.astype(np.float64).mean()),
                          float(np.percentile(values, 99)), self.same / count if count else float("nan"))
