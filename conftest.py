"""Repository-level pytest setup, shared by ``tests/`` and the doctests of ``dynemb/``.

It is not part of the package: it only gives the docstring examples the names a reader
would have imported anyway (``torch``, the public names of :mod:`dynemb`, and TorchRec's
``EmbeddingConfig``, ``KeyedJaggedTensor``, ``JaggedTensor``), so each example states only
its own setup.

The CUDA backend runs under numba's simulator where torch sees no GPU, exactly as in
``tests/conftest.py`` describes; it has to be chosen before anything imports ``numba.cuda``,
hence before :mod:`dynemb`. This file is the one place that chooses it: pytest loads it first
for every test path under the repository (its rootdir), with or without xdist.
"""
import os
import sys

import pytest
import torch

if os.environ.get("DYNEMB_REAL_CUDA") == "1":
    # a run meant to prove the kernels on a GPU must not pass on the simulator instead
    if not torch.cuda.is_available():
        raise pytest.UsageError("DYNEMB_REAL_CUDA=1 but torch sees no GPU")
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
elif not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if "numba.core.config" in sys.modules:
    # pytest imports numba before any conftest (the ini's filterwarnings names a numba warning
    # class), so numba has already read its environment: make it read the choice above
    if "numba.cuda" in sys.modules:
        raise pytest.UsageError("numba.cuda was imported before conftest.py chose its backend")
    sys.modules["numba.core.config"].reload_config()
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # kernels that never synchronize run their threads one by one (tests/sequential_cudasim.py)
    from tests.sequential_cudasim import install as _install_sequential_cudasim

    _install_sequential_cudasim()
# the suite runs the parallel CPU kernels on every thread numba has; the library's default
# (one core less than the process has, dynemb.backends.threads) is tested in fresh processes by
# tests/test_threads.py
os.environ.setdefault("DYNEMB_THREADS", "off")


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace):
    """What every docstring example may use without importing it."""
    import dynemb
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    doctest_namespace["torch"] = torch
    doctest_namespace.update({name: getattr(dynemb, name) for name in dynemb.__all__})
    doctest_namespace.update(EmbeddingConfig=EmbeddingConfig, JaggedTensor=JaggedTensor,
                             KeyedJaggedTensor=KeyedJaggedTensor)

