"""Memory after each RULER trial of one process: where a many-prompt process's growth lives (docs/benchmarks.md,
"Many questions or trials in one process").

    OMP_NUM_THREADS=1 python docs/results/trial_memory.py BOOK --method pyramidkv --samples 8
    OMP_NUM_THREADS=1 python docs/results/trial_memory.py BOOK --method snapkv --samples 4 --recap 0
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 MALLOC_MMAP_THRESHOLD_=1048576 python docs/results/trial_memory.py BOOK ...

Reads as ``kvcli ruler BOOK --tasks niah_single_1,niah_multikey_1,niah_single_2 --lengths 4k --cache 1024`` does
(``run_ruler``, ``--dtype auto``, seed 5; ``--recap 0``: as ``kvcli ruler --recap 0``, the question read in the same
forward as the prompt) and prints a line a trial: the trial's peak resident set (its
``peak_memory_bytes``), the resident set after it, the bytes of every CPU tensor still alive, and glibc's heap
(``mallinfo2``: bytes in use and free inside the arena). Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the kvcli source folder this file sits in


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tensor_mib() -> float:
    import torch

    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
    return sum(t.untyped_storage().nbytes() for t in alive) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("book", type=Path)
    parser.add_argument("--method", default="pyramidkv")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--recap", type=int, help="recap tokens (default: kvcli ruler's)")
    args = parser.parse_args()
    from kvcli.eval.ruler import Book, run_ruler
    from kvcli.models.load import load_model
    from kvcli.reading.recap import RECAP_TOKENS

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    loaded = load_model()

    def on_trial(trial, done, total) -> None:
        heap = libc.mallinfo2()
        print(f"trial {done}/{total}: peak {trial.peak_memory_bytes / 2**30:.2f} GiB, resident {resident_mib():.0f} "
              f"MiB, tensors {tensor_mib():.0f} MiB, heap in use {heap.uordblks / 2**20:.0f} MiB, free "
              f"{heap.fordblks / 2**20:.0f} MiB", flush=True)

    run_ruler(loaded.model, loaded.tokenizer, Book(args.book.read_text(encoding="utf-8")),
              ["niah_single_1", "niah_multikey_1", "niah_single_2"], [args.method], lengths=[4096],
              samples=args.samples, budget=1024, seed=5, on_trial=on_trial,
              recap=RECAP_TOKENS if args.recap is None else args.recap)


if __name__ == "__main__":
    main()
