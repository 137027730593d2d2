"""``DynamicEmbFusedOptimizer``: the TorchRec-style optimizer object of a dynamic collection."""
from __future__ import annotations

from typing import Any

from torchrec.optim.fused import FusedOptimizer


class DynamicEmbFusedOptimizer(FusedOptimizer):
    """The optimizer object of a :class:`~dynemb.DynamicEmbCollection`, TorchRec style: updates happen
    in backward, so ``step`` and ``zero_grad`` do nothing; ``param_groups[0]["lr"]`` is the
    learning rate used by the next backward (LR schedulers work on it).

    Example::

        >>> ec = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="t", embedding_dim=8, num_embeddings=1024, feature_names=["f"])])
        >>> ec.fused_optimizer.param_groups[0]["lr"] = 0.01
        >>> ec.fused_optimizer.lr
        0.01
    """

    def __init__(self, lr: float):
        super().__init__({}, {}, [{"params": [], "lr": lr}])

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None
