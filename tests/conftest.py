"""Backends under test: the CPU kernels always; the CUDA kernels on a GPU when there is one,
otherwise under numba's CUDA simulator (set before anything imports numba.cuda).

``DYNEMB_REAL_CUDA=1`` demands the GPU: the simulator stays off even if the environment asks
for it, and a machine where torch sees no GPU stops the run instead of falling back to it.
"""
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if os.environ.get("DYNEMB_REAL_CUDA") == "1":
    # a run meant to prove the kernels on a GPU must not pass on the simulator instead
    if not ON_GPU:
        raise pytest.UsageError("DYNEMB_REAL_CUDA=1 but torch sees no GPU")
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
elif not ON_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

#: (backend name, device its tensors live on)
BACKENDS = [("cpu", "cpu"), ("cuda", "cuda" if ON_GPU else "cpu")]


@pytest.fixture(params=BACKENDS, ids=[b for b, _ in BACKENDS])
def backend(request):
    """(backend, device) pair; every conformance test runs once per backend."""
    return request.param


@pytest.fixture
def make_table(backend):
    """Factory of ScoredHashTable on the backend under test."""
    from dynemb.rows.hash_table import ScoredHashTable

    name, device = backend

    def make(capacity, **kwargs):
        return ScoredHashTable(capacity, device=device, backend=name, **kwargs)

    return make


@pytest.fixture
def to_dev(backend):
    """Build an int64 tensor on the backend's device."""
    device = backend[1]

    def convert(values):
        return torch.as_tensor(values, dtype=torch.int64, device=device)

    return convert
