"""Small probes for scripts/gpu_check.sh.

- ``versions``: the Python packages that matter here, their versions and where they load from.
- ``numba-cuda``: exit 0 if numba-cuda runs a kernel on a torch CUDA tensor (without a GPU:
  compiles one to PTX).
- ``junit PATH``: counts of a pytest JUnit XML file, failures split into those that need
  fbgemm's CUDA ops (absent where only fbgemm-gpu-cpu is installed) and the others.
"""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import sys
import xml.etree.ElementTree as ET

PACKAGES = ["torch", "numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core",
            "cuda-pathfinder", "cupy-cuda13x", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu",
            "tensordict", "torchmetrics", "pytest", "hypothesis", "dynemb"]
#: The error torch raises for an op with no kernel for CUDA tensors.
FBGEMM_CUDA = re.compile(r"fbgemm::\w+.*\bCUDA\b|CUDA.*fbgemm::\w+", re.S)


def versions() -> int:
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    for name in PACKAGES:
        try:
            print(f"{name:<16} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"{name:<16} -")
    for module in ("torch", "numba", "numba_cuda", "torchrec", "fbgemm_gpu", "dynemb"):
        try:
            print(f"import {module:<11} {importlib.import_module(module).__file__}")
        except Exception as error:  # report, do not stop: this is a diagnosis
            print(f"import {module:<11} FAILED: {type(error).__name__}: {error}")
    try:
        import torch
        if torch.cuda.is_available():
            print(f"torch cuda {torch.version.cuda}, device {torch.cuda.get_device_name()}, "
                  f"capability {torch.cuda.get_device_capability()}")
        else:
            print("torch sees no GPU")
    except Exception as error:
        print(f"torch.cuda: {error}")
    return 0


def numba_cuda_runs() -> int:
    """Runs a kernel on a torch CUDA tensor; without a GPU, compiles one to PTX instead."""
    import torch
    from numba import cuda

    def add_one(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += 1

    version = f"numba-cuda {metadata.version('numba-cuda')}, numpy {metadata.version('numpy')}"
    if not torch.cuda.is_available():
        from numba import types
        cuda.compile_ptx(add_one, (types.Array(types.int64, 1, "C"),), cc=(9, 0))
        print(f"{version}: compiled a kernel to PTX (no GPU to run it)")
        return 0
    x = torch.arange(64, device="cuda", dtype=torch.int64)
    cuda.jit(add_one)[1, 64](cuda.as_cuda_array(x))
    torch.cuda.synchronize()
    ok = bool((x.cpu() == torch.arange(1, 65)).all())
    print(f"{version}: ran a kernel, result {'right' if ok else 'WRONG'}")
    return 0 if ok else 1


def junit(path: str) -> int:
    """Prints one line: passed, failed (of which need fbgemm CUDA), errors, skipped."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        print(f"no JUnit results ({error})")
        return 1
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    fbgemm, others = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
            kind = "errors"
        else:
            kind = "failed"
        if bad is not None:
            counts[kind] += 1
            text = (bad.get("message") or "") + (bad.text or "")
            (fbgemm if FBGEMM_CUDA.search(text) else others).append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    print(", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; needing fbgemm CUDA ops: {len(fbgemm)}")
    for name in others:
        print(f"  failed: {name}")
    for name in fbgemm:
        print(f"  needs fbgemm CUDA ops: {name}")
    return 0


def main(argv) -> int:
    if argv[:1] == ["versions"]:
        return versions()
    if argv[:1] == ["numba-cuda"]:
        return numba_cuda_runs()
    if argv[:1] == ["junit"] and len(argv) == 2:
        return junit(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
