"""Layer 1, the KV cache and what touches it inside a forward: per-layer storage (and its packed low-bit
form), the attention function kvcli registers with transformers, the observation window's scores, the
rotation that re-assigns positions, each layer's facts read from the model, and the static decode step.

It knows no method by name: methods (:mod:`kvcli.methods`) decide what is kept, this layer keeps it.
"""
