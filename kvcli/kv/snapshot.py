"""A compressed cache as named tensors and JSON-able facts, and back: what a saved read stores.

A saved read (:mod:`kvcli.reading.saved`) is a safetensors file: tensors by name plus a JSON header, so that
loading one never unpickles or runs anything. This module turns a :class:`~kvcli.kv.cache.KVCache` into
that pair and rebuilds a cache from it:

* every layer's data attributes as they are (keys at their entry rotation, values, entry positions, stream
  indices, per-token method state, a layer subclass's own tensors such as PoD's near keys), tensors by the
  name ``LAYER.ATTRIBUTE`` (``LAYER.ATTRIBUTE.KEY`` inside a dict), everything else in the layer's facts;
* a packed store of a quantized cache (:class:`~kvcli.kv.quant.QuantizedTokens`) as its five tensors, rebuilt
  around the fresh cache's own quantizer, so the bits and key mode are the engine's, never the file's;
* the cache's stream counters.

Restoring starts from the engine's fresh cache (its class, windows, RoPE frequencies and quantizer) and
fills exactly the attributes a layer has: a name the layer does not have, one it has that the file lacks, a
tensor of the wrong rank or length, anything that is not a tensor, number, string or list of them is a
:class:`ValueError` (the caller words it as a damaged file).
"""

from __future__ import annotations

import torch

from kvcli.kv.basis import KeyBasis
from kvcli.kv.quant import QuantizedTokens, rotation

__all__ = ["SnapshotError", "restore_cache", "snapshot_cache"]

#: A layer's back-reference to its cache and its transient attention record are not its data.
_SKIP = ("owner", "record")
#: The cache's own counters a read leaves behind.
_COUNTERS = ("block_start", "stream_start", "keep_positions")
#: What a packed store holds besides its quantizer (QuantizedTokens.__init__): tensors, then facts.
_PACKED_TENSORS = ("packed", "scale", "zero", "front", "tail")
_PACKED_FACTS = ("mode", "bits", "group", "sinks", "dim")
_SCALARS = (bool, int, float, str, type(None))


class SnapshotError(ValueError):
    """A cache that cannot be saved (it holds an object that is not data), or a snapshot that does not fit."""


def snapshot_cache(cache) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors (on the CPU, contiguous, by name) and the facts (JSON-able) of ``cache``."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for index, layer in enumerate(cache.layers):
        facts = {}
        for key, value in vars(layer).items():
            if key not in _SKIP:
                facts[key] = _encode(value, f"{index}.{key}", tensors)
        layers.append(facts)
    return tensors, {"counters": {name: getattr(cache, name) for name in _COUNTERS}, "layers": layers}


def restore_cache(cache, tensors: dict[str, torch.Tensor], facts: dict, device: torch.device):
    """Fill the fresh ``cache`` (an engine's :meth:`new_cache`) with a snapshot; return it."""
    counters, layers = facts["counters"], facts["layers"]
    if not isinstance(layers, list) or len(layers) != len(cache.layers):
        raise SnapshotError("the number of layers differs")
    cache.block_start, cache.stream_start = _int(counters["block_start"]), _int(counters["stream_start"])
    cache.keep_positions = bool(counters["keep_positions"])
    for index, (layer, saved) in enumerate(zip(cache.layers, layers, strict=True)):
        required = set(vars(layer)) - set(_SKIP)
        if not isinstance(saved, dict) or set(saved) - required - {"dtype", "device", "keys", "values"}:
            raise SnapshotError(f"layer {index} holds attributes a layer does not have")
        missing = required - set(saved)
        if missing:
            raise SnapshotError(f"layer {index} lacks {', '.join(sorted(missing))}")
        for key, value in saved.items():
            setattr(layer, key, _decode(value, f"{index}.{key}", tensors, cache, device))
        if layer.is_initialized:
            layer.device = device
        _check_layer(layer, index)
    return cache


# --- one value ------------------------------------------------------------------------------------------------


def _encode(value, name: str, tensors: dict[str, torch.Tensor]):
    """``value`` as a JSON-able fact, its tensors put in ``tensors`` under ``name`` (and the names below it)."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().to("cpu").contiguous()
        return {"tensor": name}
    if isinstance(value, QuantizedTokens):
        extra = {**({f"grid.{part}": t for part, t in value.grid.tensors().items()} if value.grid else {}),
                 **({"queries": value.queries} if value.queries is not None else {})}
        for part, tensor in [*((part, getattr(value, part)) for part in _PACKED_TENSORS), *extra.items()]:
            tensors[f"{name}.{part}"] = tensor.detach().to("cpu").contiguous()
        return {"packed": name, **{fact: getattr(value, fact) for fact in _PACKED_FACTS},
                "rotated": value.rotation is not None, "dtype": str(value.dtype), "grid": value.grid is not None,
                "observed": value.observed}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, torch.device):
        return {"device": None}  # a restored cache lives on the loading engine's device
    if isinstance(value, dict):
        return {"dict": {str(key): _encode(item, f"{name}.{key}", tensors) for key, item in value.items()}}
    if isinstance(value, list | tuple) and all(isinstance(item, _SCALARS) for item in value):
        return {"list": list(value)}
    if isinstance(value, _SCALARS):
        return {"value": value}
    raise SnapshotError(f"{name} is a {type(value).__name__}, which a saved read cannot hold")


def _decode(fact, name: str, tensors: dict[str, torch.Tensor], cache, device: torch.device):
    """The value :func:`_encode` made ``fact`` of, its tensors moved to ``device``."""
    if not isinstance(fact, dict) or len(fact) == 0:
        raise SnapshotError(f"{name} is not a value of a snapshot")
    kind = next(iter(fact))
    if kind == "tensor":
        return _tensor(tensors, fact["tensor"], name).to(device, copy=True)  # the snapshot serves every question
    if kind == "packed":
        return _packed(fact, name, tensors, cache, device)
    if kind == "dtype":
        return _dtype(fact["dtype"], name)
    if kind == "device":
        return device
    if kind == "dict" and isinstance(fact["dict"], dict):
        return {key: _decode(item, f"{name}.{key}", tensors, cache, device) for key, item in fact["dict"].items()}
    if kind == "list" and isinstance(fact["list"], list) and all(isinstance(x, _SCALARS) for x in fact["list"]):
        return list(fact["list"])
    if kind == "value" and isinstance(fact["value"], _SCALARS):
        return fact["value"]
    raise SnapshotError(f"{name} is not a value of a snapshot")


def _tensor(tensors: dict[str, torch.Tensor], key: str, name: str) -> torch.Tensor:
    if key != name or key not in tensors:
        raise SnapshotError(f"tensor {name} is missing")
    return tensors[key]


def _dtype(text, name: str) -> torch.dtype:
    value = getattr(torch, text.removeprefix("torch."), None) if isinstance(text, str) else None
    if not isinstance(value, torch.dtype):
        raise SnapshotError(f"{name}: {text!r} is not a dtype")
    return value


def _packed(fact: dict, name: str, tensors: dict[str, torch.Tensor], cache, device: torch.device) -> QuantizedTokens:
    """A packed store around ``cache``'s own quantizer, which must round as the saved one did."""
    quant = cache.kv_quant
    if quant is None or fact.get("bits") != quant.bits or fact.get("packed") != name:
        raise SnapshotError(f"{name} was packed at {fact.get('bits')} bits, this cache at {quant and quant.bits}")
    rotates = quant.rotates(str(fact.get("mode")))
    if fact.get("rotated") is not rotates or fact.get("group") != quant.group_of(_int(fact.get("dim"))):
        raise SnapshotError(f"{name} was rounded another way than this cache rounds (rotation or group differ)")
    store = object.__new__(QuantizedTokens)  # filled below with exactly what __init__ sets
    store.config = quant
    for part in _PACKED_FACTS:
        setattr(store, part, _int(fact[part]) if part != "mode" else str(fact[part]))
    store.rotation = rotation(store.dim, device) if rotates else None
    store.dtype, store.device = _dtype(fact["dtype"], name), device
    for part in _PACKED_TENSORS:
        setattr(store, part, _tensor(tensors, f"{name}.{part}", f"{name}.{part}").to(device, copy=True))
    store.grid, store.queries, store.observed = _grid(fact, name, tensors, store, device)
    return store


def _grid(fact: dict, name: str, tensors: dict[str, torch.Tensor], store: QuantizedTokens, device: torch.device
          ) -> tuple[KeyBasis | None, torch.Tensor | None, int]:
    """A ``pca`` store's fixed grid, or the queries it has weighed so far and how many blocks of them."""
    heads = store.tail.shape[1]
    if fact.get("grid") is True:
        if store.mode != "pca":
            raise SnapshotError(f"{name} holds a key grid but rounds {store.mode!r}")
        parts = {part: _tensor(tensors, f"{name}.grid.{part}", f"{name}.grid.{part}").to(device, copy=True)
                 for part in KeyBasis.PARTS}
        try:
            return KeyBasis.from_tensors(parts, heads, store.dim, store.bits), None, 0
        except ValueError as exc:
            raise SnapshotError(f"{name}: {exc}") from None
    if store.mode == "pca" and store.sealed:
        raise SnapshotError(f"{name} holds keys rounded on axes but not the axes")
    queries = tensors.get(f"{name}.queries")
    if queries is not None and (queries.dtype != torch.float32 or tuple(queries.shape) != (1, heads, 1, store.dim)):
        raise SnapshotError(f"{name}: its queries do not fit its keys")
    return None, None if queries is None else queries.to(device, copy=True), _int(fact.get("observed", 0))


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(f"{value!r} is not an integer")
    return value


def _check_layer(layer, index: int) -> None:
    """Raise if a restored layer's tensors do not fit together: keys and values ``[1, H, T, D]`` with the ``T``
    of the ``[H, T]`` bookkeeping and of every per-token state; entry positions only where keys are stored after
    RoPE (a layer whose keys are stored before it keeps none)."""
    if not layer.is_initialized:
        return
    length = layer.values.shape[2]
    if len(layer.values.shape) != 4 or len(layer.keys.shape) != 4 or layer.keys.shape[2] != length:
        raise SnapshotError(f"layer {index}: keys and values do not fit together")
    positions = [("token_idx", layer.token_idx)]
    if not (layer.pre_rope and layer.entry_pos is None):
        positions.append(("entry_pos", layer.entry_pos))
    for what, value in [*positions, *layer.state.items()]:
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != length:
            raise SnapshotError(f"layer {index}: {what} does not fit the keys")
