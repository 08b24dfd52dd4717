"""Layer 0, what comes in and goes out: sources and their tokens, results on stdout and progress on stderr,
files written whole (outputs, rows, state files), the ranks of a job, and ``torch`` imported on first use.

Nothing here knows a model's cache or a method; every other layer may import from here.
"""
