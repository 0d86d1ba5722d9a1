"""Install-time extras that pyproject.toml cannot express: the deepspeed-alias `.pth` hook.

`zeroshard_as_deepspeed.pth` goes to site-packages next to the package, for a regular install
(build_py) and for an editable one (`pip install -e .`, editable_wheel). At interpreter start-up
it activates `import deepspeed` -> zeroshard only when ZEROSHARD_AS_DEEPSPEED is set
(zeroshard/compat/__init__.py); otherwise it costs one environment lookup.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "zeroshard_as_deepspeed.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: int = 1) -> list:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class _AddPth:
    """Wraps setuptools' editable strategy so the editable wheel carries the hook too."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __enter__(self) -> "_AddPth":
        self._inner.__enter__()
        return self

    def __exit__(self, *exc) -> object:
        return self._inner.__exit__(*exc)

    def __call__(self, wheel, files, mapping) -> None:
        self._inner(wheel, files, mapping)
        with open(os.path.join(HERE, PTH)) as f:
            wheel.writestr(PTH, f.read())


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _AddPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
