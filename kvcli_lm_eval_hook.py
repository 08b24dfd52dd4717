"""Makes plain ``lm_eval --model kvcli`` work with lm-eval 0.4.x, which discovers no plugins by itself.

``pip install kvcli`` puts ``kvcli_lm_eval_hook.pth`` in site-packages (setup.py); Python runs its one line,
``import kvcli_lm_eval_hook``, at every start of the environment. So this module must cost next to nothing:
it imports only ``sys`` (never kvcli, torch, transformers or lm_eval) and puts a finder first on
``sys.meta_path`` that answers for one module name only, ``lm_eval.models``, and returns None for any other.

When ``lm_eval.models`` is imported (lm-eval's ``get_model`` imports it before its first look-up; the
package fills lm-eval's model registry with lazy ``"module:Class"`` placeholders), the finder lets the
ordinary import run and then adds one placeholder of the same kind through lm-eval's public registry
API: ``model_registry.register("kvcli", target="kvcli.lm_eval:KvcliLM")``. kvcli itself (torch and all) is
imported only if lm-eval is asked for that model. The finder then takes itself off ``sys.meta_path``.

It waits for ``lm_eval.models`` rather than ``lm_eval.api.registry`` on purpose: lm-eval imports
``lm_eval.models``, and with it its built-in models, only while the registry is empty, so an entry added
as soon as the registry exists would hide ``hf`` and the rest.

Nothing here may ever stop lm-eval from importing: any error in the registration is swallowed (the
model is then missing, and ``python -m kvcli.lm_eval`` still registers it by importing kvcli.lm_eval).
"""

import sys

#: The module whose import is watched, the model name and lm-eval's lazy placeholder for it.
WATCHED = "lm_eval.models"
MODEL = "kvcli"
TARGET = "kvcli.lm_eval:KvcliLM"


def register() -> bool:
    """Add the lazy ``kvcli`` entry to lm-eval's model registry unless the name is taken (by kvcli.lm_eval
    itself when it was imported first). True when the name is registered afterwards."""
    try:
        from lm_eval.api.registry import model_registry

        if MODEL not in model_registry:
            model_registry.register(MODEL, target=TARGET)
        return MODEL in model_registry
    except Exception:  # noqa: BLE001 - a failure here must never break lm_eval's own import
        return False


class _ThenRegister:
    """The real loader of ``lm_eval.models``, with :func:`register` run once the module has executed."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # The module keeps its real loader (importlib.resources and friends ask it), not this wrapper.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        register()

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class Finder:
    """First on ``sys.meta_path``: for ``lm_eval.models`` only, the spec the other finders give, its loader
    wrapped in :class:`_ThenRegister`; None for every other name (one string comparison)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        uninstall()  # one import only, and no recursion into this finder below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


def install() -> None:
    """Watch for ``lm_eval.models``; register at once if it is already imported."""
    if WATCHED in sys.modules:
        register()
    elif Finder not in sys.meta_path:
        sys.meta_path.insert(0, Finder)


def uninstall() -> None:
    while Finder in sys.meta_path:
        sys.meta_path.remove(Finder)


install()
