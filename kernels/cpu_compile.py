"""How the CPU kernels ask numba to compile them, chosen for compile time as much as run time.

A kernel's first call on a machine compiles it (seconds to minutes on a small CPU; cached
afterwards), so two habits of numba that cost compile time and buy no speed are turned off:

- Only a kernel's explicit ``prange`` loops run in parallel (:func:`prange_loops`). With
  ``parallel=True`` numba also turns every array expression (``stats[:] = 0``,
  ``column.sum()``) into a parallel loop of its own, each compiled as a separate function; on
  the few entries such expressions touch here that is slower to compile and no faster to run.
- Large helpers (a table's claim loop, a store's write-back) are plain ``@njit`` functions,
  not ``inline="always"``: numba inlines those by copying their IR into every caller and
  compiling it again there, LLVM inlines small functions anyway, and a helper compiled once
  is cached once. Tiny helpers shared with the CUDA kernels (hashing, scoring, prefetch)
  stay inlined.

Measured on a 2-core CPU (``find_or_insert_cpu`` alone, empty cache): 66 s of compilation
with both habits, 21 s without inlining, 13 s with neither; the same run time.

Example::

    @njit(cache=True, parallel=prange_loops())
    def kernel(out):
        for i in prange(out.size):
            out[i] = i
"""


def prange_loops() -> dict:
    """numba's ``parallel`` options that parallelize explicit ``prange`` loops only (a new
    dict each call: numba consumes it)."""
    return dict(prange=True, comprehension=False, reduction=False, inplace_binop=False,
                setitem=False, numpy=False, stencil=False, fusion=False)
