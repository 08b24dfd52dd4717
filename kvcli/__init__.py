"""kvcli: stream documents of any length through a language model with a KV cache of fixed size."""

__version__ = "0.1.0"
