"""Layer 3, the block-streaming engine: a stream fed to the model block by block, the cache compressed by
the method after every block (or layer by layer for a nested method), positions re-assigned past the
trained context, and the negative log-likelihood of every token summed as it streams.
"""
