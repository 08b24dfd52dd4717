"""Layer 5, measurements: perplexity over documents and streams (with checkpoints and KL against a
reference), the pass-key probe (``needle``), RULER's tasks, the benchmark grids and the analyses of what
each method keeps.
"""
