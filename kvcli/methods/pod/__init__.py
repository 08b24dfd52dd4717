"""PoD (Ma et al., "Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention
Similarity"): proximal tokens get full attention, distant tokens share one set of keys per block of
similar layers.

* :mod:`kvcli.methods.pod.groups`: the layer-groups file (JSON) and the groups shipped for the default model;
* :mod:`kvcli.methods.pod.attention`: Eq. 3-4 (the fast path and a literal per-query reference);
* :mod:`kvcli.methods.pod.cache`: the cache layer that frees distant keys outside each head's lead layer;
* :mod:`kvcli.methods.pod.method`: the ``pod`` method that puts them together (imported here, so that
  :mod:`kvcli.methods`, which imports every module beside it, registers it);
* :mod:`kvcli.methods.pod.adapt`: the paper's lightweight post-training (``kvcli pod adapt``).

Calibration, which runs the model over documents, is a measurement: :mod:`kvcli.eval.analysis.calibrate`.
"""

from kvcli.methods.pod.method import PoD

__all__ = ["PoD"]
