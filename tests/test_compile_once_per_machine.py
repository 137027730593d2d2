"""Processes of one machine compile a CPU kernel once (the ranks of a job, the workers of a
test run), and the wait is announced: two fresh interpreters with an empty kernel cache,
started together, claim slots in a table; numba's compile events show which of them compiled
the claim kernel."""
import os
import subprocess
import sys
import textwrap

CLAIM = textwrap.dedent("""
    import sys
    import torch
    from numba.core import event
    compiled = []

    class Seen(event.Listener):
        def on_start(self, e):
            compiled.append(e.data["dispatcher"].py_func.__name__)

        def on_end(self, e):
            pass

    event.register("numba:compile", Seen())
    from dynemb.rows.hash_table import ScoredHashTable

    table = ScoredHashTable(1 << 12, device="cpu", backend="cpu")
    table.find_or_insert(torch.arange(100))
    assert table.size() == 100
    print("compiled find_or_insert_cpu" if "find_or_insert_cpu" in compiled else "loaded")
""")


def test_two_processes_started_together_compile_the_claim_kernel_once(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("RANK", None)
    runs = [subprocess.Popen([sys.executable, "-c", CLAIM], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outs]
    said = sorted(out.strip() for out, _ in outs)
    assert said == ["compiled find_or_insert_cpu", "loaded"], outs
    compiling_err = next(err for out, err in outs if out.startswith("compiled"))
    assert "dynemb: compiling its CPU kernels for this machine, once" in compiling_err
