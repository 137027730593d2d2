"""A kernel compiles without numba warnings: a user's first run (empty kernel cache) shows no
warning that is not about the user's own code.

The suite's ini turns numba's type-safety warnings into errors wherever a test compiles a
kernel; a kernel already in the cache compiles nowhere, so the kernels that once warned are
compiled here in a fresh interpreter with an empty cache.
"""
import os
import subprocess
import sys
import textwrap

STORE_FIND_GROUP = textwrap.dedent("""
    import warnings
    import numpy as np
    from numba.core.errors import NumbaWarning
    from numba.typed import List
    from dynemb.kernels import group_stores_cpu

    warnings.simplefilter("error", NumbaWarning)
    keys = List([np.full(8, -(2**63), dtype=np.int64)])
    rows = List([np.zeros((8, 4), dtype=np.int32)])
    out_rows, found = np.zeros((1, 4), np.int32), np.ones(1, bool)
    group_stores_cpu.store_find_group_cpu(
        keys, rows, np.array([1]), np.array([8]), np.array([True]), np.array([5]),
        np.array([0, 1]), np.array([True]), out_rows, found)
    assert not found[0]
""")


def test_store_find_group_compiles_without_a_warning(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", STORE_FIND_GROUP], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
