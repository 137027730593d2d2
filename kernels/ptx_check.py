"""Compile every CUDA kernel to PTX for a real GPU architecture, no GPU needed.

The simulator runs Python the real compiler rejects; this catches that. Needs numba-cuda's
NVVM/NVRTC wheels (the ``cu13`` extra) and must run without ``NUMBA_ENABLE_CUDASIM``.

Usage: ``python -m dynemb.kernels.ptx_check [--cc 9.0]``
"""
import argparse
import os
import sys
import time


def kernel_signatures():
    """Name -> (kernel, numba signature) with the argument types the launchers pass."""
    from numba import types as nt

    from . import init_cuda, optim_cuda, round_cuda, table_cuda

    i64, i32, b1, f32, f64 = nt.int64, nt.int32, nt.boolean, nt.float32, nt.float64
    k64 = nt.Array(i64, 1, "C")
    r32 = nt.Array(i32, 1, "C")
    mask = nt.Array(b1, 1, "C")
    rows = nt.Array(nt.float32, 2, "C")
    bits32 = nt.Array(i32, 2, "C")
    bits16 = nt.Array(nt.int16, 2, "C")
    t = table_cuda
    return {
        "find_kernel": (t.find_kernel, (k64, i64, i64, k64, k64)),
        "lookup_update_kernel": (t.lookup_update_kernel,
                                 (k64, k64, r32, i64, i64, k64, k64, k64, i64, i64, b1, k64, k64)),
        "insert_missing_kernel": (t.insert_missing_kernel,
                                  (k64, k64, r32, k64, i64, i64, k64, k64, k64, i64, i64, b1, k64,
                                   k64, k64, mask)),
        "erase_kernel": (t.erase_kernel, (k64, k64, r32, k64, i64, i64, k64, mask, mask)),
        "add_refcounts_kernel": (t.add_refcounts_kernel, (r32, k64, i64)),
        "export_kernel": (t.export_kernel, (k64, k64, i64, i64, k64, k64, k64, k64)),
        "rehash_kernel": (t.rehash_kernel, (k64, k64, r32, k64, k64, r32, i64, i64, k64, k64)),
        "init_rows_kernel": (init_cuda.init_rows_kernel,
                             (rows, k64, i64, i64, i64, f64, f64, f64, f64)),
        "init_rows_at_kernel": (init_cuda.init_rows_at_kernel,
                                (rows, k64, k64, mask, i64, i64, i64, i64, f64, f64, f64, f64)),
        "fused_update_kernel": (optim_cuda.fused_update_kernel,
                                (rows, k64, rows, i64, i64) + (f32,) * 8),
        "round_rows_kernel": (round_cuda.round_rows_kernel,
                              (bits32, bits16, k64, i64, i64, i64, i64, b1)),
    }


def compile_all(cc=(9, 0)):
    """Compile each kernel; returns {name: ptx text}. Raises on the first failure."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        raise RuntimeError("unset NUMBA_ENABLE_CUDASIM: the simulator cannot compile PTX")
    from numba import cuda

    out = {}
    for name, (kernel, sig) in kernel_signatures().items():
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
        out[name] = ptx
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 for H100")
    args = parser.parse_args(argv)
    cc = tuple(int(p) for p in args.cc.split("."))
    t0 = time.perf_counter()
    ptx = compile_all(cc)
    for name, text in ptx.items():
        print(f"{name}: {len(text.splitlines())} PTX lines")
    print(f"compiled {len(ptx)} kernels for sm_{cc[0]}{cc[1]} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
