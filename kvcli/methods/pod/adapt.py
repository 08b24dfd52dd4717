"""PoD's lightweight post-training (section 2.2): fine-tune a model with PoD attention active.

PoD changes what the non-lead layers of a block see (distant scores come from the lead), so the
paper continues training on a few billion tokens with the sharing structure in place (learning rate
1e-5, cosine schedule). This is that loop at kvcli's scale: full fine-tuning (every weight; no
adapter library is needed), next-token loss over consecutive ``seq_len``-token pieces of the
documents, PoD attention through :func:`kvcli.methods.pod.attention.sequence_attention` (differentiable,
the same computation the cache path runs, see ``tests/test_pod.py``).

What it writes into ``out``:

* a Hugging Face model folder (weights, config, tokenizer) that ``load_model(out)`` loads, and
  ``pod_groups.json`` beside it, which ``-o groups=auto`` picks for that folder;
* ``adapt-state.pt`` while training: weights, optimizer, step; :func:`adapt` resumes from it, and
  Ctrl-C saves it (and the model so far) before it stops. It is removed when training completes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcli.errors import KvcliError, UsageError
from kvcli.io.outputs import lock_folder
from kvcli.io.statefile import load_state as read_state
from kvcli.io.statefile import save_state as write_state
from kvcli.methods.pod.attention import (
    SEQUENCE_ATTENTION,
    SHARED_KWARG,
    SharedForward,
    SharingPlan,
    register_sequence_attention,
)
from kvcli.methods.pod.groups import GROUPS_IN_MODEL_FOLDER, GroupsFile

STATE_FILE = "adapt-state.pt"


@dataclass
class AdaptResult:
    """How a run of :func:`adapt` ended."""

    out: Path
    steps: int  # optimizer steps done in total (resumed ones included)
    total_steps: int
    tokens: int  # tokens trained on in total
    losses: list[float]  # loss of every step of this run
    seconds: float
    interrupted: bool = False
    resumed_from: int = 0


def training_pieces(documents: Iterable, tokenizer, seq_len: int) -> Iterator[torch.Tensor]:
    """Consecutive ``seq_len + 1``-token pieces of the documents' token stream (inputs and next-token targets)."""
    from kvcli.io.text import token_stream

    buffer: list[int] = []
    for chunk in token_stream(list(documents), tokenizer):
        buffer.extend(chunk.ids)
        while len(buffer) >= seq_len + 1:
            yield torch.tensor(buffer[: seq_len + 1], dtype=torch.long)
            buffer = buffer[seq_len:]  # the last target is the next piece's first input


def load_state(path: Path) -> dict:
    """The saved training state at ``path``, read as data only (:func:`kvcli.io.statefile.load_state`).

    The file sits in a folder other people may write: it is never unpickled beyond tensors, numbers,
    strings and containers, so a crafted file can never run code, and its checksum refuses a cut or
    altered one. Anything that is not a state this module wrote (unreadable, damaged, a key missing or
    of the wrong type) is one line, never a traceback.
    """
    advice = "remove it or use another --out"
    state = read_state(path, "kvcli adapt state", advice)
    expected = {"model": dict, "optimizer": dict, "step": int, "total": int, "groups": list}
    if any(not isinstance(state.get(k), t) or isinstance(state.get(k), bool) for k, t in expected.items()):
        raise KvcliError(f"{path} is not a kvcli adapt state (keys {sorted(expected)} expected): {advice}")
    if not 0 <= state["step"] <= state["total"]:
        raise KvcliError(f"{path} is not a kvcli adapt state (step {state['step']} of {state['total']}): {advice}")
    return state


def cosine_lr(step: int, total: int, lr: float) -> float:
    """The paper's cosine annealing, from ``lr`` at step 0 to 0 after ``total`` steps."""
    return 0.5 * lr * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def check_settings(*, tokens: int, seq_len: int, lr: float, sinks: int, recent: int) -> None:
    """Raise :class:`UsageError` for settings that cannot train (checked before any model loads, by the CLI too):
    no whole piece, a piece with no distant token, a learning rate that is not a positive finite number (NaN or
    infinity would save NaN weights as an adapted model), a negative number of sinks or recent tokens."""
    if sinks < 0 or recent < 0:
        raise UsageError(f"--sinks and --recent count tokens: at least 0, not {sinks if sinks < 0 else recent}")
    if tokens < seq_len or seq_len < 2:
        raise UsageError(f"need at least one piece: tokens ({tokens}) >= tokens per piece ({seq_len}) >= 2")
    if seq_len <= sinks + recent:  # every token would be proximal: the sharing would not be trained at all
        raise UsageError(f"no query of a {seq_len}-token sequence sees a distant token with {sinks} sinks + {recent} "
                         "recent: raise the tokens per sequence or lower the recent window")
    if not 0 < lr < math.inf:
        raise UsageError(f"--lr (the learning rate) must be a positive finite number, not {lr}")


def adapt(model: torch.nn.Module, tokenizer, documents: Iterable, groups: GroupsFile, out: str | Path, *,
          tokens: int, seq_len: int = 2048, lr: float = 1e-5, sinks: int = 16, recent: int = 1024,
          save_every: int = 50, seed: int = 0,
          on_step: Callable[[int, int, float], None] | None = None) -> AdaptResult:
    """Fine-tune ``model`` on ``tokens`` tokens of ``documents`` with PoD attention (``groups``, n_s, n_r) active.

    One optimizer step per ``seq_len``-token piece (AdamW, cosine learning rate from ``lr``). Every
    ``save_every`` steps and on Ctrl-C the state goes to ``out/adapt-state.pt``; calling again with
    the same ``out`` resumes after the last saved step (the pieces are deterministic). ``out`` is held
    for the run (:func:`kvcli.io.outputs.lock_folder`): a second run into it is refused at once. The model is
    saved to ``out`` as a Hugging Face folder with ``pod_groups.json``. ``on_step(step, total, loss)``
    reports progress.
    """
    groups.check_model(model.config)
    check_settings(tokens=tokens, seq_len=seq_len, lr=lr, sinks=sinks, recent=recent)
    with lock_folder(Path(out), "--out") as folder:  # one run per folder: two would overwrite each other's state
        return _adapt(model, tokenizer, documents, groups, folder, tokens=tokens, seq_len=seq_len, lr=lr,
                      sinks=sinks, recent=recent, save_every=save_every, seed=seed, on_step=on_step)


def _adapt(model: torch.nn.Module, tokenizer, documents: Iterable, groups: GroupsFile, out: Path, *, tokens: int,
           seq_len: int, lr: float, sinks: int, recent: int, save_every: int, seed: int,
           on_step: Callable[[int, int, float], None] | None) -> AdaptResult:
    """:func:`adapt` in the folder it holds."""
    total = tokens // seq_len
    plan = SharingPlan(groups.leads(), sinks, recent)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start = 0
    state_path = out / STATE_FILE
    if state_path.is_file():
        state = load_state(state_path)
        if state["groups"] != groups.groups or state["total"] != total:
            raise UsageError(f"{state_path} belongs to another run (groups or tokens differ): use another --out")
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise KvcliError(f"{state_path} does not fit this model ({type(exc).__name__}): use another --out") \
                from None
        start = state["step"]

    def save_state(step: int) -> None:
        write_state(state_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                 "total": total, "groups": groups.groups})

    register_sequence_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(SEQUENCE_ATTENTION)
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    step = start
    started = time.perf_counter()
    interrupted = False
    try:
        for index, piece in enumerate(training_pieces(documents, tokenizer, seq_len)):
            if index >= total:
                break
            if index < start:
                continue
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, total, lr)
            piece = piece.to(device)
            logits = model(input_ids=piece[None, :-1], use_cache=False, **{SHARED_KWARG: SharedForward(plan)}).logits
            loss = torch.nn.functional.cross_entropy(logits[0].float(), piece[1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            losses.append(float(loss.detach()))
            if on_step:
                on_step(step, total, losses[-1])
            if save_every and step % save_every == 0 and step < total:
                save_state(step)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        model.eval()
        model.set_attn_implementation(previous)
    if step == start and not interrupted and start < total:
        raise UsageError(f"the documents hold fewer than {seq_len + 1} tokens: nothing to train on")
    if interrupted or step < total:
        save_state(step)
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError as exc:  # a full disk: the state saved above still resumes the run
        raise KvcliError(f"--out {out}: cannot save the model ({exc.strerror or exc})") from None
    groups.save(out / GROUPS_IN_MODEL_FOLDER)
    if step >= total and state_path.is_file():
        state_path.unlink()
    return AdaptResult(out, step, total, step * seq_len, losses, time.perf_counter() - started,
                       interrupted or step < total, start)
