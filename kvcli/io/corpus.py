"""A corpus job: one row per document, shared among ranks, resumable after any kind of death.

The commands decide what a document's row holds (a perplexity, a summary, an answer); this module
decides which documents this process reads, where finished rows go, and what the job's result is:

* **Resume.** A row is appended to its rows file (a whole line per write, see
  :class:`kvcli.io.outputs.RowLog`) as soon as its document is done; with ``resume`` the documents
  whose rows are already there are skipped. A document is known by its real path (any spelling of
  it), and a row that recorded its content (:func:`content_of`) is reused only while the document's
  bytes still hash the same: an edited file is refused with one line, never mixed in. A document
  cut short by Ctrl-C is reported but never written, so it is read again on resume.
* **Identity.** Every row written records the settings that made it (``run``, see :mod:`kvcli.io.identity`);
  ``resume`` refuses rows of another command, model, method, budget, dtype or question with one line
  naming what differs, before any document is read.
* **Empty documents.** A document with nothing to read (:class:`kvcli.errors.EmptyDocumentError`) is
  skipped with a warning and a row ``{"document": ..., "skipped": "empty"}``, so the job finishes and a
  resumed job skips it too; a corpus of one document fails with the error instead.
* **Ranks.** Under ``torchrun``/``accelerate launch`` the documents still to do are dealt to the
  ranks longest first, each to the rank with the fewest bytes so far (:func:`shard`). Every rank
  appends to its own part file beside the rows file (``rows.jsonl.rank1``) and sends its rows to
  rank 0, which puts every row in document order: the same rows, in the same order, as one process
  produces. Rank 0 then rewrites the rows file with them at once and removes the parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcli.errors import EmptyDocumentError, KvcliError
from kvcli.io.documents import Document
from kvcli.io.identity import as_json, first_difference
from kvcli.io.outputs import RowLog, SideFailures, read_rows
from kvcli.io.ranks import Ranks

#: What a command does with one document: its row (without the ``document`` key, which the job
#: adds) and whether the document was read to its end; None to stop before it (a token limit).
Process = Callable[[int, Document], "tuple[dict, bool] | None"]


def shard(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of each rank's documents: longest first, each to the rank with the fewest bytes so far
    (ties to the lower rank), every rank's share in document order. Deterministic, so every rank
    computes the same deal without a message."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += sizes[index]
        shares[rank].append(index)
    return [sorted(share) for share in shares]


@dataclass
class CorpusResult:
    """What a corpus job produced; complete on rank 0, this rank's own rows elsewhere."""

    rows: list[dict]  # one per document with a row, in document order (resumed ones included)
    new: list[bool]  # per row: computed by this job (False: taken from the rows file)
    seconds: float  # wall time of the job
    interrupted: bool = False
    ranks: Ranks = field(default_factory=Ranks)

    @property
    def resumed(self) -> int:
        return sum(1 for fresh in self.new if not fresh)


def row_key(name: str) -> str:
    """What identifies a row's document: an existing file by its real path (``books/a.txt`` and
    ``/data/books/a.txt`` are one document), anything else (``<stdin>``, ``pg19[3]``) by its name."""
    path = Path(name)
    return str(path.resolve()) if path.is_file() else name


#: Keys a ``ppl`` row records its document's content under: the raw bytes it read, counted and hashed.
CONTENT_KEYS = ("content_bytes", "content_sha256")


def content_of(doc: Document) -> dict:
    """A row's record of what it read (nothing for a document without bytes of its own)."""
    if doc.read is None or doc.open_bytes is None:
        return {}
    return {"content_bytes": doc.read.count, "content_sha256": doc.read.sha256}


def _check_content(doc: Document, row: dict, path: Path, flag: str) -> None:
    """Refuse to reuse a row made from other content than the document holds now (a file edited since)."""
    if not all(key in row for key in CONTENT_KEYS):
        return  # a row of an older kvcli, or of a command that records no content
    if not doc.content_matches(int(row["content_bytes"]), str(row["content_sha256"])):
        raise KvcliError(f"{flag} {path}: the row of {doc.name} was made from other content (its first "
                         f"{int(row['content_bytes']):,} bytes differ now): remove that line to read it again, or "
                         "run without --resume to start over")


def _check_identity(row: dict, identity: dict, path: Path, flag: str) -> dict:
    """``row`` without its record of the run that made it, after refusing a row of another run."""
    run = row.get("run")
    if isinstance(run, dict) and run.get("command") != identity.get("command"):
        differs = f"it is a row of kvcli {run.get('command')}, this run is {identity.get('command')}"
    else:
        differs = first_difference(run, identity)
    if differs is not None:
        raise KvcliError(f"{flag} {path}: the row of {row['document']} was not made by this run ({differs}): choose "
                         f"another {flag} file, or run without --resume to start over")
    return {key: value for key, value in row.items() if key != "run"}


#: What a skipped document's row says: why it holds no measurement.
SKIPPED_EMPTY = "empty"


def _skipped(doc: Document, error: EmptyDocumentError, warn: Callable[[str], None]) -> tuple[dict, bool]:
    """The row of a document with nothing to read, after one warning."""
    warn(f"{error.name} {error.why}: skipped")
    return {"skipped": SKIPPED_EMPTY, **content_of(doc)}, True


def _warn(message: str) -> None:
    from kvcli.io.report import warn

    warn(message)


def part_path(path: Path, rank: int) -> Path:
    """The rows file rank ``rank`` appends to while several ranks run."""
    return path.with_name(f"{path.name}.rank{rank}")


def _parts(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.rank*"))


def run_corpus(documents: list[Document], process: Process, *, rows_path: Path | None = None,
               flag: str = "--rows", resume: bool = False, ranks: Ranks | None = None,
               on_row: Callable[[dict], None] | None = None, failures: SideFailures | None = None,
               identity: dict | None = None, warn: Callable[[str], None] | None = None) -> CorpusResult:
    """Run ``process`` over the documents this rank is dealt and gather every row on rank 0.

    ``on_row`` sees each row this rank finishes, as it finishes (a command printing rows as they
    come). ``resume`` skips documents whose rows are in ``rows_path`` or its part files, once every
    row there is found to be made with ``identity`` (the settings each row written records as its
    ``run``; see :mod:`kvcli.io.identity`). With ``failures``, a rows file that cannot be written any more
    (a full disk) is noted there and the job goes on without it, so its result is still reported;
    without, the error ends the job. ``warn`` says which documents were skipped as empty.
    """
    ranks = ranks or Ranks()
    identity = as_json(identity or {})
    warn = warn or _warn
    started = time.perf_counter()
    rows_file = None if rows_path is None else _RowsFile(rows_path, flag, identity, failures)
    done = {} if rows_file is None else rows_file.open(documents, resume, ranks)
    todo = [i for i, doc in enumerate(documents) if row_key(doc.name) not in done]
    sizes = [documents[i].size or 0 for i in todo]
    share = [todo[position] for position in shard(sizes, ranks.world_size)[ranks.rank]]
    mine, cut = _process_share(documents, share, process, warn, on_row, rows_file)
    gathered = ranks.gather((mine, cut))
    if gathered is None:  # not rank 0: its rows are in its part file and on rank 0
        return CorpusResult([row for _, row in mine], [True] * len(mine), time.perf_counter() - started,
                            cut is not None, ranks)
    fresh = {index: row for pairs, _ in gathered for index, row in pairs}
    cuts = {index for _, index in gathered if index is not None}
    rows, new, written = _in_document_order(documents, fresh, cuts, done)
    if rows_file is not None and (ranks.distributed or _parts(rows_path)):
        rows_file.join(written, documents, done)
    return CorpusResult(rows, new, time.perf_counter() - started, bool(cuts), ranks)


def _process_share(documents: list[Document], share: list[int], process: Process, warn: Callable[[str], None],
                   on_row: Callable[[dict], None] | None, rows_file: _RowsFile | None) -> tuple[list, int | None]:
    """Run ``process`` over this rank's documents (``share``: their indices, in document order) until one is cut
    short or ``process`` stops: this rank's ``(index, row)`` pairs, each finished row appended to the rows file,
    and the document Ctrl-C cut short (reported, never written), or None."""
    mine: list[tuple[int, dict]] = []
    plan = getattr(process, "plan", None)
    if plan is not None:  # a process that reads ahead (documents batched) is told which documents come, in order
        plan([(index, documents[index]) for index in share])
    for index in share:
        doc = documents[index]
        try:
            outcome = process(index, doc)
        except EmptyDocumentError as error:
            if len(documents) == 1:
                raise
            outcome = _skipped(doc, error, warn)
        if outcome is None:
            break
        row, complete = outcome
        row = {"document": doc.name, **row}
        mine.append((index, row))
        if on_row is not None:
            on_row(row)
        if not complete:
            return mine, index
        if rows_file is not None:
            rows_file.append(row)
    return mine, None


def _in_document_order(documents: list[Document], fresh: dict[int, dict], cuts: set[int],
                       done: dict[str, dict]) -> tuple[list[dict], list[bool], list[dict]]:
    """Every row of the job in document order (the ``fresh`` ones every rank made, by document index, and those
    ``done`` before), whether each is fresh, and the rows the file keeps: all but those Ctrl-C cut short."""
    rows: list[dict] = []
    new: list[bool] = []
    written: list[dict] = []
    for index, doc in enumerate(documents):
        if index in fresh:
            rows.append(fresh[index])
            new.append(True)
            if index not in cuts:
                written.append(fresh[index])
        elif row_key(doc.name) in done:
            rows.append(done[row_key(doc.name)])
            new.append(False)
            written.append(done[row_key(doc.name)])
    return rows, new, written


@dataclass
class _RowsFile:
    """A job's rows file as this rank writes it: the file itself in a single process, a part file beside it
    under several ranks, which rank 0 joins into the file at the end (:meth:`join`)."""

    path: Path
    flag: str
    identity: dict  # the run every row written records, and every row reused must have
    failures: SideFailures | None  # where a file that fails is noted while the job goes on (None: it ends the job)
    log: RowLog | None = None  # where this rank appends (None once it failed under ``failures``)

    def open(self, documents: list[Document], resume: bool, ranks: Ranks) -> dict[str, dict]:
        """Check the file on every rank, start (or repair) it on rank 0, and return the rows already done by
        document key (with ``resume``; else the file and its parts start empty)."""
        main_log = RowLog(self.path, self.flag)  # checks the path on every rank, before any work
        if ranks.main:
            main_log.start(resume)
            if not resume:
                for part in _parts(self.path):
                    part.unlink()
        ranks.barrier()  # rank 0 has cleared or repaired the files
        done = self._done(documents) if resume else {}
        ranks.barrier()  # every rank has read the same rows before any rank writes
        self.log = RowLog(part_path(self.path, ranks.rank), self.flag) if ranks.distributed else main_log
        if ranks.distributed:
            self.log.start(False)
        return done

    def _done(self, documents: list[Document]) -> dict[str, dict]:
        """The rows in the file and its parts by document key, once none is found made by another run
        (:func:`_check_identity`) or from other content than its document holds now (:func:`_check_content`)."""
        done: dict[str, dict] = {}
        for source in (self.path, *_parts(self.path)):
            for row in read_rows(source):
                done.setdefault(row_key(row["document"]), _check_identity(row, self.identity, self.path, self.flag))
        for doc in documents:
            if row_key(doc.name) in done:
                _check_content(doc, done[row_key(doc.name)], self.path, self.flag)
        return done

    def append(self, row: dict) -> None:
        """Append a finished row with the run that made it."""
        if self.log is None:
            return
        try:
            self.log.append({**row, "run": self.identity})
        except KvcliError as exc:
            if self.failures is None:
                raise
            self.failures.add(str(exc))
            self.log = None

    def join(self, written: list[dict], documents: list[Document], done: dict[str, dict]) -> None:
        """On rank 0 at the end: rewrite the file at once with the job's rows (``written``) and the rows of other
        documents it held, then remove the part files (left in place when the rewrite fails)."""
        names = {row_key(doc.name) for doc in documents}
        others = [row for name, row in done.items() if name not in names]  # rows of other documents stay
        try:
            RowLog(self.path, self.flag).rewrite([{**row, "run": self.identity} for row in written + others])
        except KvcliError as exc:
            if self.failures is None:
                raise
            self.failures.add(str(exc))
            return  # the parts stay
        for part in _parts(self.path):
            part.unlink()
