"""PoD (Ma et al., "Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention
Similarity"): proximal tokens get full attention, distant tokens share one set of keys per block of
similar layers.

* :mod:`kvcli.pod.groups`: the layer-groups file (JSON) and the groups shipped for the default model;
* :mod:`kvcli.pod.attention`: Eq. 3-4 (the fast path and a literal per-query reference);
* :mod:`kvcli.pod.cache`: the cache layer that frees distant keys outside each head's lead layer;
* :mod:`kvcli.methods.pod`: the ``pod`` method that puts them together.

This package is core (it sits beside the cache and the attention function); calibration, which runs
the model over documents, is a workflow: :mod:`kvcli.analysis.calibrate`.
"""
