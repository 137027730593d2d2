"""Numba kernels behind dynemb, installed as ``dynemb.kernels``.

One semantics, two backends. Each hot operation has a CPU kernel (``*_cpu.py``, ``@njit``) and a
CUDA kernel (``*_cuda.py``, ``@cuda.jit``); the per-key logic both call lives in plain ``@njit``
functions (``hashing.py``, ``rng.py``) that numba-cuda compiles as device functions.

Conventions:
- keys are int64; ``EMPTY_KEY`` and ``TOMBSTONE_KEY`` are reserved (see ``constants.py``);
- slot ``s`` lives in bucket ``s // bucket_size`` at position ``s % bucket_size``;
- every kernel skips input keys equal to ``EMPTY_KEY`` so callers may pad batches.

Importing this package does not import ``numba.cuda``: the CUDA kernels load on first use.
"""
