"""The training loop the sharded twins share (tests/sharded_twin.py, tests/sharded_bag_twin.py)
and what it records: the sharded module, the unsharded reference on the global batch and,
optionally, TorchRec's own sharded module, stepped side by side on the same batches.

The result keys each scenario returns: ``plan``; per step ``losses`` / ``outputs`` (the
sharded module on this rank's batch), ``ref_losses`` / ``ref_outputs`` (the reference's, for
this rank's part of the global batch), ``{twin}_losses`` / ``{twin}_outputs`` (TorchRec's);
``pipelined`` (the modules a train pipeline took over); at the end ``rows`` / ``ref_rows``
(``(ids, rows)`` per table), ``stats`` / ``ref_stats`` and ``modes``.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tests.torchrec_probes import pipelined_module_types

#: (loss, {feature: output}) of the reference for this rank's part of a step's global batch
ReferenceStep = Callable[[int], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


def draw_batches(s, world_size: int, features: Sequence[str],
                 draw: Callable[[int, str, int, torch.Generator], tuple]
                 ) -> List[List[Dict[str, tuple]]]:
    """``[step][rank] -> {feature: (lengths, *draw(step, feature, n, g))}`` for the
    scenario ``s``'s steps: rank ``r`` has ``s.batch`` samples (``+ r`` when ``s.uneven``)
    of 0 to 3 ids each, ``n`` in all; one generator ``g`` seeded ``s.seed`` draws each
    feature's lengths and, right after them, what ``draw`` draws."""
    g = torch.Generator().manual_seed(s.seed)
    steps = []
    for step in range(s.steps):
        per_rank = []
        for r in range(world_size):
            b = s.batch + (r if s.uneven else 0)
            d = {}
            for f in features:
                lengths = torch.randint(0, 4, (b,), generator=g)
                d[f] = (lengths, *draw(step, f, int(lengths.sum()), g))
            per_rank.append(d)
        steps.append(per_rank)
    return steps


def plan_summary(dmp) -> Dict[str, Dict[str, Tuple[str, str]]]:
    """Per sharded module path and table: (sharding type, compute kernel) of the plan."""
    return {path: {t: (p.sharding_type, p.compute_kernel) for t, p in mp.items()}
            for path, mp in dmp.plan.plan.items()}


def initial_rows(ref, num_ids: int) -> Dict[str, torch.Tensor]:
    """Per table of ``ref``, the rows its initializer gives ids ``0..num_ids-1``: where
    TorchRec's twin starts from."""
    ids = torch.arange(num_ids)
    return {name: t.options.initializer.rows(ids, t.dim, seed=t.options.seed,
                                             table_id=t.table_id)
            for name, t in ref.tables.items()}


def train_side_by_side(result: Dict[str, Any], steps: int, lr: float, trainer, ref,
                       reference_step: ReferenceStep, twin=None, twin_key: str = "twin",
                       after_step: Optional[Callable[[int], None]] = None) -> None:
    """``steps`` steps of the sharded ``trainer``, then the reference (``reference_step``
    runs its forward and backward), then the ``twin`` trainer if any; half-way the learning
    rate halves in every model (the change must take effect in each). Each step's losses and
    outputs go to ``result`` (see the module docstring); ``after_step(step)`` runs last."""
    for key in ("losses", "outputs", "ref_losses", "ref_outputs",
                f"{twin_key}_losses", f"{twin_key}_outputs"):
        result[key] = []
    for step in range(steps):
        if step == steps // 2:
            lr = lr / 2
            trainer.set_lr(lr)
            ref.fused_optimizer.param_groups[0]["lr"] = lr
            if twin:
                twin.set_lr(lr)
        _record(result, "", *trainer.step())
        if trainer.pipeline is not None and step == 0:
            result["pipelined"] = pipelined_module_types(trainer.dmp)
        ref_loss, ref_outputs = reference_step(step)
        _record(result, "ref_", ref_loss, {f: v.detach() for f, v in ref_outputs.items()})
        if twin:
            _record(result, f"{twin_key}_", *twin.step())
        if after_step is not None:
            after_step(step)


def _record(result: Dict[str, Any], prefix: str, loss: torch.Tensor,
            outputs: Dict[str, torch.Tensor]) -> None:
    result[f"{prefix}losses"].append(float(loss))
    result[f"{prefix}outputs"].append({f: v.numpy().copy() for f, v in outputs.items()})


def record_rows(result: Dict[str, Any], sharded, ref, num_ids: int) -> None:
    """The rows, counters and storage modes of the sharded module (this rank's share) and of
    the reference, after training."""
    ids = torch.arange(num_ids)
    result["rows"], result["ref_rows"] = {}, {}
    for name in ("t0", "t1"):
        rows, found = sharded.read_rows(name, ids)
        result["rows"][name] = (ids[found].numpy(), rows[found].numpy())
        ref_rows, ref_found = ref.read_rows(name, ids)
        result["ref_rows"][name] = (ids[ref_found].numpy(), ref_rows[ref_found].numpy())
    result["stats"] = sharded.stats()
    result["ref_stats"] = ref.stats()
    result["modes"] = {k: v.value for k, v in sharded.storage_modes().items()}
