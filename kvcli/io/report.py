"""Reporting: memory readings, progress on stderr, and the result formats on stdout.

stdout carries only results (text or JSON) so that kvcli composes in shell pipelines; progress,
warnings and errors go to stderr, and progress is drawn only when stderr is a terminal.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvcli.errors import KvcliError
from kvcli.io.lazy import torch

stderr_console = Console(stderr=True, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """One line on stderr, never on stdout. The message is escaped: brackets in it are text (an install hint
    such as ``pip install 'kvcli[gemma]'``), not Rich markup that would vanish from the line."""
    stderr_console.print(f"[yellow]warning:[/yellow] {escape(message)}", markup=True)


def each_once(say: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """``say``, passing each distinct message on once: a grid builds an engine per trial, and the same warning
    about a method or a length should be read once, not once a trial."""
    if say is None:
        return None
    said: set[str] = set()

    def once(message: str) -> None:
        if message not in said:
            said.add(message)
            say(message)
    return once


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement, so that model loading does not hide the streaming peak.

    On Linux, writing 5 to ``/proc/self/clear_refs`` resets the resident-set high-water mark.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _proc_status_bytes(field: str) -> int | None:
    """A memory field of ``/proc/self/status`` (Linux, reported in KiB) in bytes, or None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most memory torch allocated. CPU: the peak resident set size of this process."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _proc_status_bytes("VmHWM")
    return peak if peak is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _proc_status_bytes("VmRSS") or 0


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def clean_json(value):
    """NaN and infinity are not JSON: report them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value


def dumps(value) -> str:
    return json.dumps(clean_json(value), ensure_ascii=False)


def write_stdout(text: str) -> None:
    """Write to stdout now; a reader that went away (``| head``) ends the program quietly with exit 0, and
    a stdout that cannot take the result (closed, a full disk, ``/dev/full``) is one line and exit 1.

    stdout is then pointed at /dev/null, so that the interpreter's flush at exit is silent too.
    """
    if sys.stdout is None:
        raise KvcliError("stdout is closed: the result has nowhere to go (redirect it to a file or /dev/null)")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        raise SystemExit(0) from None
    except OSError as exc:
        _silence_stdout()
        raise KvcliError(f"cannot write the result to stdout: {exc.strerror or exc}") from None


def _silence_stdout() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def print_result(text: str) -> None:
    """A whole result on stdout, ending with one newline."""
    write_stdout(text if text.endswith("\n") else text + "\n")


class StdoutStream:
    """Generated text to stdout piece by piece, as it is produced."""

    def __init__(self):
        self.wrote = ""

    def write(self, text: str) -> None:
        write_stdout(text)
        self.wrote += text

    def end(self) -> None:
        if not self.wrote.endswith("\n"):
            self.write("\n")


class StreamProgress:
    """A Rich progress line on stderr: tokens, tokens/s, running perplexity, cache size, memory."""

    def __init__(self, total: int | None, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled and sys.stderr.isatty()
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.fields[total_text]}"),
            TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=stderr_console, transient=True,
            disable=not self.enabled,
        )
        self.task = self.progress.add_task("tokens", total=total, total_text=f"{total:,}" if total else "?",
                                           stats="")

    def update(self, processed: int, tokens_per_second: float, ppl: float, cache_tokens: int,
               label: str | None = None) -> None:
        if not self.enabled:
            return
        stats = (f"{tokens_per_second:,.0f} tok/s  ppl {ppl:,.2f}  cache {cache_tokens:,}  "
                 f"mem {mib(current_memory_bytes(self.device))}")
        fields = {"completed": processed, "stats": stats}
        if label:
            fields["description"] = label
        self.progress.update(self.task, **fields)

    @contextmanager
    def running(self) -> Iterator[StreamProgress]:
        with self.progress:
            yield self


class ReadProgress:
    """A transient line on stderr while a document is read (only when stderr is a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=stderr_console, transient=True, disable=not self.enabled)
        self.task = self.progress.add_task("reading")

    def update(self, read: int, cache_tokens: int, seconds: float) -> None:
        if self.enabled:
            rate = read / seconds if seconds > 0 else 0.0
            self.progress.update(self.task, description=f"reading {read:,} tokens  {rate:,.0f} tok/s  "
                                                        f"cache {cache_tokens:,}")

    def __enter__(self) -> ReadProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


class DocumentProgress:
    """A Rich bar over the documents of a corpus job on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed:,}/{task.total:,}"), TimeElapsedColumn(),
                                 console=stderr_console, transient=True, disable=not self.enabled)
        self.task = self.progress.add_task("documents", total=total)

    def start(self, name: str) -> None:
        self.progress.update(self.task, description=f"documents · {name}")

    def done(self) -> None:
        self.progress.advance(self.task)

    def __enter__(self) -> DocumentProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
