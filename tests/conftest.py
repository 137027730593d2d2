"""Backends under test: the CPU kernels always; the CUDA kernels on a GPU when there is one,
otherwise under numba's CUDA simulator (set before anything imports numba.cuda).

``DYNEMB_REAL_CUDA=1`` demands the GPU: the simulator stays off even if the environment asks
for it, and a machine where torch sees no GPU stops the run instead of falling back to it.
"""
import pytest
import torch

# the root conftest.py has chosen the simulator (or demanded a GPU) before this file runs
ON_GPU = torch.cuda.is_available()

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
