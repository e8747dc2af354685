"""Build hook: put the top-level host files into the wheel; everything else is in pyproject.toml.

The repository keeps ``systemd/``, ``etc/gpushare/`` and ``man/`` at its top, once
(``gpushare/shipped.py``). setuptools only packages files under a package directory, so the build
copies each of them to ``gpushare/_shipped/<same path>`` in the build tree: the wheel carries
them, the checkout never holds a second copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
HOST_DIRS = ("systemd", "etc/gpushare", "man")


class BuildPyWithHostFiles(build_py):
    """``build_py`` plus the host files, copied under ``gpushare/_shipped/``."""

    def run(self) -> None:
        """Build the package, then copy the host files into it (not for an editable install)."""
        super().run()
        if self.editable_mode:
            # An editable install runs from the checkout, where gpushare.shipped finds them.
            return
        target = Path(self.build_lib) / "gpushare" / "_shipped"
        for folder in HOST_DIRS:
            for src in sorted((HERE / folder).rglob("*")):
                if src.is_file():
                    dst = target / src.relative_to(HERE)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)


setup(cmdclass={"build_py": BuildPyWithHostFiles})
