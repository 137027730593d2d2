"""Every CUDA kernel compiles to PTX for sm_90 with the real compiler (no GPU needed).

Runs in a subprocess because the rest of the suite may use numba's simulator, which cannot
compile.
"""
import os
import subprocess
import sys


def test_every_cuda_kernel_compiles_to_ptx():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-m", "dynemb.kernels.ptx_check", "--cc", "9.0"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from dynemb.kernels.ptx_check import kernel_signatures
    for name in kernel_signatures():
        assert f"{name}: " in proc.stdout
    assert "for sm_90" in proc.stdout


def test_ptx_check_covers_every_kernel():
    from dynemb.kernels import init_cuda, optim_cuda, round_cuda, table_cuda
    from dynemb.kernels.ptx_check import kernel_signatures
    assert set(kernel_signatures()) == (set(table_cuda.KERNELS) | set(init_cuda.KERNELS)
                                        | set(optim_cuda.KERNELS) | set(round_cuda.KERNELS))
