"""The TorchRec / torch internals of ``dynemb/bridges/``, checked against the pinned versions:
each test fails when the internal its bridge relies on moves, is renamed or changes meaning."""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from torch import nn

from torchrec_versions import TORCHREC_VERSION, needs_torchrec_18

if TORCHREC_VERSION < (1, 8):  # the internals below are 1.8's (before: ImportError)
    pytest.skip(needs_torchrec_18("memory stashing and backward injection, the internals "
                                  "these bridges use"), allow_module_level=True)

from torchrec.distributed import memory_stashing as torchrec_stashing  # noqa: E402
from torchrec.distributed.train_pipeline import experimental_pipelines, train_pipelines  # noqa: E402
from torchrec.distributed.train_pipeline import utils as pipeline_utils  # noqa: E402

from dynemb.bridges import (device_assert, ems_pipelines, memory_stashing,  # noqa: E402
                            prefetch_pipeline)

Manager = torchrec_stashing.MemoryStashingManager


def attributes_set_on_self(function) -> set:
    """Names of the ``self.<name> = ...`` assignments in ``function``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                     and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


@pytest.fixture
def clean_manager():
    Manager.reset()
    yield
    Manager.reset()


# -- memory_stashing: the MemoryStashingManager's class-level lists ---------------------------

def test_memory_stashing_finds_torchrecs_manager():
    assert memory_stashing.MemoryStashingManager is Manager
    assert memory_stashing.DEFAULT_CHUNK_BYTES == torchrec_stashing._STASH_CHUNK_SIZE_BYTES


def test_a_queued_restore_runs_at_restore_embedding_weights_once(clean_manager):
    calls = []

    def restore(grad, event):
        calls.append((grad, event))

    memory_stashing.queue_restore(restore)
    memory_stashing.queue_restore(restore)  # still queued: not twice
    Manager.restore_embedding_weights()
    assert calls == [(None, None)]
    Manager.restore_embedding_weights()
    assert len(calls) == 1


def test_delayed_stashes_run_at_execute_pending_stashes(clean_manager):
    assert not memory_stashing.delay_stash_enabled()
    Manager.set_delay_stash(True)
    assert memory_stashing.delay_stash_enabled()
    ran = []
    memory_stashing.queue_pending_stash(ran.append)
    Manager.execute_pending_stashes()
    assert ran == [None]


def test_the_trunk_size_is_the_managers(clean_manager):
    assert memory_stashing.chunk_bytes() == memory_stashing.DEFAULT_CHUNK_BYTES
    Manager.set_trunk_size(4096)
    assert memory_stashing.chunk_bytes() == 4096
    dst, src = torch.zeros(3000), torch.arange(3000.0)
    memory_stashing.copy_in_chunks(dst, src)
    assert torch.equal(dst, src)


def test_the_manager_is_off_without_streams(clean_manager):
    assert not memory_stashing.manager_enabled()
    assert memory_stashing.manager_streams() == (None, None)


# -- ems_pipelines: what TorchRec's EMS constructor sets up ---------------------------------

def test_init_without_streams_sets_what_torchrecs_constructor_sets(clean_manager):
    ems = experimental_pipelines.TrainPipelineSparseDistEmbStash
    base = attributes_set_on_self(train_pipelines.TrainPipelineSparseDist.__init__)
    assert attributes_set_on_self(ems.__init__) - base == set(ems_pipelines.EMS_ATTRIBUTES)
    assert "__init__" not in vars(experimental_pipelines.TrainPipelinePrefetchEMS) or \
        not attributes_set_on_self(experimental_pipelines.TrainPipelinePrefetchEMS.__init__)
    model = nn.Linear(2, 2)
    pipeline = ems.__new__(ems)
    ems_pipelines.init_without_streams(pipeline, model, torch.optim.SGD(model.parameters(), 0.1),
                                       torch.device("cpu"), "over", delay_stash=True,
                                       stash_site_fqn="under", kwargs={})
    assert pipeline._injection_site.fqn == "over"
    assert (pipeline._delay_stash, pipeline._stash_site_fqn) == (True, "under")
    assert pipeline._stash_hook_handle is None
    assert memory_stashing.delay_stash_enabled()


# -- prefetch_pipeline: TorchRec's _prefetch step, overridden on CPU -------------------------

def test_the_prefetch_step_and_its_helper_are_where_the_bridge_reads_them():
    torchrecs = train_pipelines.PrefetchTrainPipelineSparseDist
    assert prefetch_pipeline.PrefetchTrainPipelineSparseDist._prefetch is not torchrecs._prefetch
    assert "_prefetch" in vars(torchrecs)
    assert list(inspect.signature(pipeline_utils._prefetch_embeddings).parameters) == [
        "batch", "context", "pipelined_modules", "device", "stream_context",
        "data_dist_stream", "default_stream"]
    model = nn.Linear(2, 2)
    pipeline = prefetch_pipeline.PrefetchTrainPipelineSparseDist(
        model, torch.optim.SGD(model.parameters(), 0.1), torch.device("cpu"))
    assert pipeline._data_dist_stream is None
    assert pipeline._pipelined_modules == [] and pipeline._device == torch.device("cpu")
    assert callable(pipeline._stream_context)


# -- device_assert: torch's asynchronous assert ----------------------------------------------

def test_the_device_assert_passes_true_and_fails_false():
    device_assert.assert_on_device(torch.tensor(True), "never")
    with pytest.raises(RuntimeError, match="other ids"):
        device_assert.assert_on_device(torch.tensor(False), "other ids")


# -- numba_launch: numba-cuda's kernel argument marshalling --------------------------------
# numba's real dispatcher cannot be imported next to its simulator (which the suite runs):
# these checks run in a child process without NUMBA_ENABLE_CUDASIM.

def numba_launch_checks() -> None:
    """The direct launch's arguments equal those of numba's own ``_Kernel._prepare_args`` for
    each argument kind the kernels take (on a GPU the launcher also checks this at each
    kernel's first launch, and keeps numba's launch where they differ); the internals it
    calls exist."""
    import numpy as np
    from cuda.core import LaunchConfig, launch  # what numba's launch calls
    from numba.cuda import types as nt
    from numba.cuda._compat import CUDA_CORE_GE_1_0
    from numba.cuda.cudadrv.devicearray import _StridedLayoutShim, _StridedMemoryViewShim
    from numba.cuda.dispatcher import CUDADispatcher, _Kernel
    from dynemb.bridges import numba_launch

    class FakeDeviceArray:
        """What numba's launch reads of a device array, over a CPU tensor's memory."""
        __cuda_memory__ = True

        def __init__(self, t):
            item = t.element_size()
            self._strided_memory_view_shim = _StridedMemoryViewShim(
                # numba's view of a null device pointer (an empty array's) is None
                ptr=t.data_ptr() or None, shape=tuple(t.shape),
                dtype=np.dtype(str(t.dtype)[6:]),
                size=t.numel(), _layout=_StridedLayoutShim(
                    strides_in_bytes=tuple(s * item for s in t.stride()), is_contiguous_c=True,
                    is_contiguous_f=t.dim() < 2, is_contiguous_any=True))

    assert callable(CUDADispatcher.typeof_pyval) and callable(launch)
    assert isinstance(LaunchConfig, type) and CUDA_CORE_GE_1_0 in (True, False)
    assert all(name in vars(_Kernel) or name in ("argument_types", "cooperative", "debug",
                                                  "_codelibrary")
               for name in numba_launch._NUMBA_INTERNALS)
    kernel = object.__new__(_Kernel)
    kernel.extensions = []
    rows, keys, none = torch.zeros(5, 3), torch.arange(7), torch.empty(0)
    assert none.data_ptr() == 0
    types = (nt.Array(nt.float32, 2, "C"), nt.Array(nt.int64, 1, "C"),
             nt.Array(nt.float32, 1, "C"), nt.int64, nt.int32, nt.float32, nt.float64,
             nt.boolean)
    args = (rows, keys, none, 12, 3, np.float32(0.5), 0.25, True)
    theirs = []
    for ty, value in zip(types, (*map(FakeDeviceArray, args[:3]), *args[3:])):
        kernel._prepare_args(ty, value, 0, [], theirs)
    mine = numba_launch._driver_args(types, args)
    assert [numba_launch._comparable(x) for x in mine] == \
        [numba_launch._comparable(x) for x in theirs], (mine, theirs)
    assert mine[:9] == [0, 0, 15, 4, rows.data_ptr(), 5, 3, 12, 4]
    # cuda.core's launch refuses None: the empty array's null pointer goes as 0
    assert None in theirs and None not in mine
    print("numba_launch checks passed")


def test_numba_launch_builds_the_driver_arguments_numba_builds():
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c",
                           "import test_bridges; test_bridges.numba_launch_checks()"],
                          env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
                          cwd=os.path.dirname(__file__), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "checks passed" in proc.stdout, proc.stderr[-3000:]


def test_numba_launch_keys_each_overload_by_dtype_and_rank():
    from dynemb.bridges import numba_launch
    assert numba_launch._signature((torch.zeros(2, 3), 1, True)) == \
        ((torch.float32, 2, -1), int, bool)  # -1: torch's index of the CPU
    assert numba_launch._signature((torch.zeros(4, 3).t(),)) is None  # numba's own launch


def test_sharded_tensors_gives_the_local_rows_of_torchrecs_sharded_weights():
    from torchrec import EmbeddingConfig
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from dynemb.bridges.sharded_tensors import row_pieces
    from tests.torchrec_twin import TorchRecTwin
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    twin = TorchRecTwin([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=6,
                                         feature_names=["f"])], {"t": rows},
                        dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1))
    weight = twin.dmp.state_dict()["ec.embeddings.t.weight"]
    total, pieces = row_pieces(weight, "t")
    assert total == 6 and len(pieces) == 1 and pieces[0][0] == 0
    assert torch.equal(pieces[0][1], rows)
    (momentum,) = twin.dmp.fused_optimizer.state_dict()["state"]["ec.embeddings.t.weight"]\
        .values()
    total, pieces = row_pieces(momentum, "t.momentum1")
    assert total == 6 and pieces[0][1].shape == (6,)
    with pytest.raises(ValueError, match="only plain tensors and TorchRec's ShardedTensor"):
        row_pieces([1, 2], "t")
