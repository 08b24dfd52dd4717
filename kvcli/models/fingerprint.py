"""What names a model by its content, not its name: the SHA-256 of its files, and the libraries that compute with it.

A stream checkpoint (:mod:`kvcli.eval.checkpoint`) and a saved read (:mod:`kvcli.reading.saved`) are valid
only for the model that made them: the same files under another name or path are that model, another file
under the same name is not.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path

import torch

from kvcli.errors import KvcliError
from kvcli.models.cache import file_sha256
from kvcli.models.load import source_path

__all__ = ["MODEL_FILES", "fingerprint", "library_versions", "model_difference"]

#: The files of a model folder that make its numbers, by part: what ``from_pretrained`` reads from the folder's
#: top level. Other files (a README, a licence, an ``original/`` copy of the weights) are not the model's.
MODEL_FILES = {
    "weights": ("*.safetensors", "*.bin", "*.gguf"),
    "config": ("config.json",),
    "tokenizer": ("tokenizer*", "vocab*", "merges*", "special_tokens_map.json", "added_tokens.json", "*.tiktoken"),
}


def fingerprint(spec: str) -> dict[str, str]:
    """The SHA-256 of the model ``spec`` names, per part (weights, config, tokenizer): one GGUF file holds all
    three; a folder's are its :data:`MODEL_FILES`; a Hugging Face id's are those of its downloaded snapshot.

    Each file's hash is :func:`kvcli.models.cache.file_sha256`'s, which the model cache remembers against the file's
    ``stat``, so a model is hashed once (when first used), not again on every resume or load.
    """
    path = source_path(spec)
    if not path.exists():
        path = _snapshot(spec)
    if path.is_file():
        digest = file_sha256(path)
        return dict.fromkeys(MODEL_FILES, digest)
    files = sorted(item for item in path.iterdir() if item.is_file() and not item.name.startswith("."))
    parts = {}
    for part, patterns in MODEL_FILES.items():
        digest = hashlib.sha256()
        for item in files:
            if any(fnmatch.fnmatch(item.name, pattern) for pattern in patterns):
                digest.update(f"{item.name}\t{file_sha256(item)}\n".encode())
        parts[part] = digest.hexdigest()
    return parts


def _snapshot(spec: str) -> Path:
    """The folder of the Hugging Face model ``spec`` as downloaded (it was, to load): never the network."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - whatever the hub library raises, the answer is the same line
        raise KvcliError(f"cannot find the files of {spec} to fingerprint them "
                         f"({type(exc).__name__})") from None


def library_versions() -> dict[str, str]:
    """The releases (major.minor) of the libraries whose kernels and model code make a checkpoint's numbers."""
    import transformers

    return {name: ".".join(version.split("+")[0].split(".")[:2])
            for name, version in (("torch", torch.__version__), ("transformers", transformers.__version__))}


def model_difference(saved, current: dict[str, str], where: str) -> str | None:
    """One clause saying which part of the model differs between the fingerprint ``saved`` in ``where`` (a file that
    names the model it was made with) and ``current``'s; None when they agree (or ``saved`` is not one)."""
    if not isinstance(saved, dict):
        return None
    for part in MODEL_FILES:
        if saved.get(part) != current.get(part):
            verb = "differ" if part == "weights" else "differs"
            return (f"the model's {part} {verb} from {where}'s (sha256 {str(saved.get(part))[:12]}... in {where}, "
                    f"{current[part][:12]}... now)")
    return None
