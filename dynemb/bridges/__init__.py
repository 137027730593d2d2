"""The TorchRec and torch internals dynemb relies on, one small module per internal.

Everything dynemb reads or overrides that TorchRec or torch keep private (a name starting
with ``_``) is used here and nowhere else, so a release that moves it changes one module, and
``tests/test_bridges.py`` (``tests/test_bridge_kjt_all_to_all.py`` for the collective) fails
on the pinned versions before anything else does:

- :mod:`~dynemb.bridges.memory_stashing`: TorchRec's ``MemoryStashingManager`` (its restore
  and pending-stash lists, its trunk size);
- :mod:`~dynemb.bridges.ems_pipelines`: what the constructor of TorchRec's EMS pipelines sets
  up, without its CUDA streams;
- :mod:`~dynemb.bridges.prefetch_pipeline`: TorchRec's prefetch pipeline with an inline
  prefetch where there is no stream (its ``_prefetch`` step, ``_prefetch_embeddings``);
- :mod:`~dynemb.bridges.kjt_all_to_all`: TorchRec's ``KJTAllToAll`` with a header ahead of
  its splits exchange (the sharded modules' step check);
- :mod:`~dynemb.bridges.device_assert`: torch's assert that runs on the device;
- :mod:`~dynemb.bridges.optimizer_marks`: the attributes torch's
  ``_apply_optimizer_in_backward`` leaves on a parameter (``_optimizer_classes``,
  ``_optimizer_kwargs``, ``_in_backward_optimizers``);
- :mod:`~dynemb.bridges.sharded_tensors`: the local shards of torch's ``ShardedTensor``
  (``torch.distributed._shard``), what TorchRec's sharded modules hold their weights and
  fused optimizer state in (a warm start reads them);
- :mod:`~dynemb.bridges.numba_launch`: numba-cuda's kernel launch (a compiled kernel's
  argument marshalling and driver function), to launch without its per-tensor conversion.
"""
