"""Every CUDA kernel of ``dynemb.kernels`` compiles to PTX for sm_90 with the real compiler
(no GPU needed), and ``ptx_check`` knows the launch signature of each.

The kernels are found here by introspection: every numba CUDA dispatcher defined in a
``kernels/*_cuda.py`` module. The check runs in a fresh interpreter because the rest of the
suite may use numba's simulator, which cannot compile.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def find_cuda_kernels():
    """{module: [kernel names]}: the CUDA kernels (dispatchers that are not device functions)
    defined in each ``*_cuda.py`` file."""
    import importlib

    from numba.cuda.dispatcher import CUDADispatcher

    import dynemb.kernels
    found = {}
    for path in sorted(Path(dynemb.kernels.__path__[0]).glob("*_cuda.py")):
        module = importlib.import_module(f"dynemb.kernels.{path.stem}")
        found[path.stem] = sorted(
            name for name, obj in vars(module).items()
            if isinstance(obj, CUDADispatcher) and obj.py_func.__module__ == module.__name__
            and not obj.targetoptions.get("device", False))  # device functions are inlined
    return found


def report():
    """Run in the fresh interpreter: print what was found and compiled, as JSON."""
    from dynemb.kernels import ptx_check
    out = {"kernels": find_cuda_kernels(),
           "signatures": sorted(ptx_check.launch_signatures()),
           "ptx": {name: text for name, text in ptx_check.compile_all((9, 0)).items()}}
    full = ptx_check.launch_signatures
    dropped = sorted(full())[0]
    ptx_check.launch_signatures = lambda: {k: v for k, v in full().items() if k != dropped}
    try:
        ptx_check.kernel_signatures()
        out["unsigned_kernel_error"] = None
    except RuntimeError as err:
        out["unsigned_kernel_error"] = [dropped, str(err)]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE)])
    proc = subprocess.run([sys.executable, "-c", "import test_ptx; test_ptx.report()"],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_module_defines_kernels(compiled):
    assert {"table_cuda", "init_cuda", "optim_cuda", "round_cuda"} <= set(compiled["kernels"])
    assert all(compiled["kernels"].values()), compiled["kernels"]
    assert "find_kernel" in compiled["kernels"]["table_cuda"]


def test_every_kernel_has_a_launch_signature(compiled):
    kernels = sorted(k for names in compiled["kernels"].values() for k in names)
    assert kernels == compiled["signatures"]


def test_every_kernel_compiles_to_ptx_for_sm_90(compiled):
    kernels = sorted(k for names in compiled["kernels"].values() for k in names)
    assert sorted(compiled["ptx"]) == kernels
    for name, ptx in compiled["ptx"].items():
        assert ".target sm_90" in ptx and ".entry" in ptx and name in ptx, name


def test_a_kernel_without_a_signature_is_reported(compiled):
    dropped, message = compiled["unsigned_kernel_error"]
    assert f"kernels without a signature ['{dropped}']" in message
