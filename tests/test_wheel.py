"""The built wheel is a working dynemb: built from the sources, installed (not editable) into a
fresh virtual environment that borrows this one's torch / torchrec / numba (no network), it
imports every module and trains three steps."""
import shutil
import site
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: what the wheel is built from: the package sources and the packaging files
SOURCES = ["dynemb", "kernels", "pyproject.toml", "setup.py", "README.md"]

TRAIN_THREE_STEPS = textwrap.dedent("""
    import importlib, pkgutil, sys
    import torch
    import dynemb
    from torchrec import EmbeddingConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    assert dynemb.__file__.startswith(sys.prefix), dynemb.__file__
    modules = [m.name for m in pkgutil.walk_packages(dynemb.__path__, "dynemb.")]
    for name in modules:
        importlib.import_module(name)
    ec = dynemb.DynamicEmbCollection(
        [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])],
        optimizer=dynemb.OptimizerConfig(dynemb.OptimizerType.SGD, learning_rate=0.5))
    ids = torch.tensor([3, 10**15, 3])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([2, 1]))
    before = ec(kjt)["f"].values().detach()  # inserts the rows; no backward
    for _ in range(3):
        ec(kjt)["f"].values().sum().backward()
    after, found = ec.read_rows("t", ids[:2])
    # SGD, loss = sum of outputs: each step moves a row by -lr per occurrence
    torch.testing.assert_close(after, before[:2] - 3 * 0.5 * torch.tensor([[2.0], [1.0]]))
    print("modules", len(modules))
""")


def test_the_wheel_installs_into_a_fresh_environment_imports_and_trains(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", str(source), "-w", str(dist)],
                   check=True, cwd=source)
    (wheel,) = dist.glob("dynemb-*.whl")
    packaged = {Path(n).parent.as_posix() for n in zipfile.ZipFile(wheel).namelist()
                if n.endswith(".py")}
    on_disk = {"dynemb/" + p.parent.relative_to(REPO / "dynemb").as_posix()
               for p in (REPO / "dynemb").rglob("__init__.py")}
    assert {p.rstrip("/.") for p in on_disk} | {"dynemb/kernels"} <= packaged

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    # torch, torchrec, numba... come from this environment, appended after the fresh one
    fresh_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                check=True, capture_output=True, text=True).stdout.strip()
    Path(fresh_site, "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run = subprocess.run([str(python), "-c", TRAIN_THREE_STEPS], cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) > 50  # every module of the package was imported
