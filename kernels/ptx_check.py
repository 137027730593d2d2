"""Compile every CUDA kernel to PTX for a real GPU architecture, no GPU needed.

The simulator runs Python the real compiler rejects; this catches that. Needs numba-cuda's
NVVM/NVRTC wheels (the ``cu13`` extra) and must run without ``NUMBA_ENABLE_CUDASIM``.

Usage: ``python -m dynemb.kernels.ptx_check [--cc 9.0]``
"""
import argparse
import importlib
import os
import pkgutil
import sys
import time


def cuda_kernels():
    """Name -> dispatcher of every ``@cuda.jit`` kernel defined in a ``*_cuda`` module of this
    package, found by introspection (a new kernel is picked up without being listed)."""
    from numba.cuda.dispatcher import CUDADispatcher

    package = sys.modules[__package__]
    found = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.endswith("_cuda"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        for name, obj in vars(module).items():
            if (isinstance(obj, CUDADispatcher) and obj.py_func.__module__ == module.__name__
                    and not obj.targetoptions.get("device", False)):  # kernels, not helpers
                if name in found:
                    raise RuntimeError(f"two CUDA kernels are named {name!r}")
                found[name] = obj
    return found


def launch_signatures():
    """Kernel name -> the numba argument types its launcher (``dynemb.backends.numba_backends``)
    passes."""
    from numba import types as nt

    i64, i32, b1, f32, f64 = nt.int64, nt.int32, nt.boolean, nt.float32, nt.float64
    k64 = nt.Array(i64, 1, "C")
    r32 = nt.Array(i32, 1, "C")
    mask = nt.Array(b1, 1, "C")
    rows = nt.Array(nt.float32, 2, "C")
    bits32 = nt.Array(i32, 2, "C")
    bits16 = nt.Array(nt.int16, 2, "C")
    f64v = nt.Array(f64, 1, "C")
    return {
        "find_kernel": (k64, i64, i64, k64, k64),
        "lookup_update_kernel": (k64, k64, r32, i64, i64, k64, k64, k64, i64, i64, b1, k64, k64),
        "insert_missing_kernel": (k64, k64, r32, k64, i64, i64, k64, k64, k64, i64, i64, b1, k64,
                                  k64, k64, mask),
        "erase_kernel": (k64, k64, r32, k64, i64, i64, k64, mask, mask),
        "add_refcounts_kernel": (r32, k64, i64),
        "export_kernel": (k64, k64, i64, i64, k64, k64, k64, k64),
        "rehash_kernel": (k64, k64, r32, k64, k64, r32, i64, i64, k64, k64),
        "init_rows_kernel": (rows, k64, i64, i64, i64, f64, f64, f64, f64),
        "init_rows_at_kernel": (rows, k64, k64, mask, i64, i64, i64, i64, f64, f64, f64, f64),
        "fused_update_kernel": (rows, k64, rows, k64, k64, nt.Array(nt.float32, 1, "C"), f32,
                                k64, k64, rows, i64, i64) + (f32,) * 8,
        "piece_sums_kernel": (rows, k64, k64, nt.Array(nt.float32, 1, "C"), f32, k64, k64, k64,
                              rows, i64),
        "pool_bags_kernel": (rows, k64, k64, nt.Array(nt.float32, 1, "C"), b1, i64, k64, i64,
                             rows),
        "round_rows_kernel": (bits32, bits16, k64, i64, i64, i64, i64, b1),
        "find_group_kernel": (k64, k64, k64, k64, i64, k64, k64),
        "lookup_update_group_kernel": (k64, k64, r32, k64, k64, k64, i64, k64, k64, k64, i64,
                                       k64, b1, k64, k64),
        "insert_missing_group_kernel": (k64, k64, r32, k64, k64, k64, k64, i64, k64, k64, k64,
                                        i64, k64, b1, k64, k64, k64, mask, mask),
        "init_rows_at_group_kernel": (rows, k64, k64, mask, k64, i64, k64, k64, k64, f64v,
                                      f64v, f64v, f64v),
        "add_claim_counts_kernel": (k64, k64, k64, mask, k64, k64, nt.Array(i64, 2, "C")),
        "gather_rows_kernel": (rows, k64, k64, i64, rows, b1, rows),
        "run_starts_kernel": (k64, k64, k64),
        "place_runs_kernel": (k64,) * 8,
        "piece_counts_kernel": (k64, i64, k64),
        "piece_rows_kernel": (k64, k64, k64),
    }


def kernel_signatures():
    """Name -> (kernel, numba signature) of every CUDA kernel; raises if a kernel has no
    signature in :func:`launch_signatures` or a signature names no kernel."""
    kernels, signatures = cuda_kernels(), launch_signatures()
    unsigned = sorted(set(kernels) - set(signatures))
    stale = sorted(set(signatures) - set(kernels))
    if unsigned or stale:
        raise RuntimeError(f"launch_signatures() is out of date: kernels without a signature "
                           f"{unsigned}, signatures without a kernel {stale}")
    return {name: (kernels[name], signatures[name]) for name in sorted(kernels)}


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
