"""Package discovery, which ``pyproject.toml`` cannot express alone: every package under
``dynemb/``, plus the top-level ``kernels/`` folder installed as ``dynemb.kernels`` (the
mapping is ``[tool.setuptools.package-dir]`` in ``pyproject.toml``). Everything else about
the project is in ``pyproject.toml``."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["dynemb", "dynemb.*"]) + ["dynemb.kernels"])
