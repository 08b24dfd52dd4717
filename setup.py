"""Everything about the project is in pyproject.toml; this file only adds ``kvcli_lm_eval_hook.pth`` to the install.

The .pth file has one line, ``import kvcli_lm_eval_hook``, which Python runs at start-up: it is how
``lm_eval --model kvcli`` finds kvcli with lm-eval 0.4.x, which reads no plugin entry points
(kvcli_lm_eval_hook.py, docs/lm-eval.md). setuptools has no setting that puts a file at the top of
site-packages (``data-files`` land under the environment's prefix), so ``build_py`` writes it:

* a wheel (``pip install .``): into ``build_lib``, whose tree becomes the top of the wheel;
* an editable install (``pip install -e .``): setuptools' editable wheel keeps nothing of ``build_lib``
  (modules are found in the source tree), but it installs whatever is written under the install
  command's ``install_lib``, which it points at the editable wheel's top folder.

Either way pip lists the file in the installation's RECORD, so ``pip uninstall kvcli`` removes it.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvcli_lm_eval_hook.pth"
LINE = "import kvcli_lm_eval_hook\n"


class BuildPyWithPth(build_py):
    """setuptools' build_py, plus ``kvcli_lm_eval_hook.pth`` at the top of what is installed."""

    def run(self) -> None:
        super().run()
        Path(self._pth_folder(), PTH).write_text(LINE, encoding="utf-8")

    def _pth_folder(self) -> str:
        if self.editable_mode:
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH))]


setup(cmdclass={"build_py": BuildPyWithPth})
