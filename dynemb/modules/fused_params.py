"""The fused optimizer configured the TorchRec way: a sharder's ``fused_params``.

TorchRec users pick the fused optimizer of their embedding tables through the sharder
(``EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
"learning_rate": 0.1})``). dynemb's sharders take the same dict; here it becomes an
:class:`~dynemb.optimizer_config.OptimizerConfig` (fbgemm's defaults for what it leaves out,
``EXACT_SGD`` when it names no optimizer, as fbgemm's TBE does) and meets the module's own
``optimizer=``: one of the two, or both equal, else a ``ValueError``. An optimizer marked on
the module's table parameters by ``apply_optimizer_in_backward`` wins over ``fused_params``
key by key, as in TorchRec (:func:`sharded_optimizer`). None of them: the module's default,
which warns at its first training use
(:class:`~dynemb.optimizer_config.DefaultOptimizerNotice`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from dynemb.optimizer_config import OptimizerConfig

#: fused_params keys that configure the optimizer; the others (caching, precision,
#: placement...) leave it alone.
OPTIMIZER_KEYS = frozenset({
    "optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay",
    "weight_decay_mode", "gradient_clipping", "max_gradient", "max_norm",
    "counter_based_regularization", "cowclip_regularization", "global_weight_decay",
    "ensemble_mode", "emainplace_mode", "extra_optimizer_config",
    "initial_accumulator_value"})


class _FbgemmDefault:
    """fbgemm TBE's optimizer when ``fused_params`` names none (``EmbOptimType.EXACT_SGD``),
    by name, which is all :meth:`OptimizerConfig.from_fbgemm` reads."""

    name = "EXACT_SGD"

    def __repr__(self) -> str:
        return "EmbOptimType.EXACT_SGD"


def checked_fused_params(fused_params: Optional[Mapping[str, Any]]) -> Optional[dict]:
    """A copy of a sharder's ``fused_params`` (None when empty); anything but a mapping with
    string keys raises ``TypeError``.

    Example::

        >>> checked_fused_params({"learning_rate": 0.1})
        {'learning_rate': 0.1}
    """
    if fused_params is None:
        return None
    if not isinstance(fused_params, Mapping) or not all(isinstance(k, str)
                                                         for k in fused_params):
        raise TypeError(f"fused_params must be a dict with string keys, got {fused_params!r}")
    return dict(fused_params) or None


def fused_params_optimizer(fused_params: Optional[Mapping[str, Any]]
                           ) -> Optional[OptimizerConfig]:
    """The :class:`OptimizerConfig` that ``fused_params`` configures, or None when it holds
    no optimizer key. Unsupported optimizers and fbgemm features raise ``ValueError``
    naming them (see :meth:`OptimizerConfig.from_fbgemm`).

    Example::

        >>> fused_params_optimizer({"learning_rate": 0.1}).type   # fbgemm's default: SGD
        <OptimizerType.SGD: 'sgd'>
        >>> fused_params_optimizer({"cache_load_factor": 0.2}) is None
        True
    """
    params = checked_fused_params(fused_params) or {}
    if not OPTIMIZER_KEYS.intersection(params):
        return None
    return OptimizerConfig.from_fbgemm(params.get("optimizer") or _FbgemmDefault(), **params)


def sharder_override(module, fused: Optional[OptimizerConfig],
                     where: Optional[str] = None) -> Optional[OptimizerConfig]:
    """The optimizer a sharder's ``fused_params`` impose on ``module`` (``fused``, from
    :func:`fused_params_optimizer`), checked against the module's own: None when they
    configure none (the module keeps its own), ``fused`` when the module was given no
    ``optimizer=`` or an equal one; a different one raises ``ValueError`` naming the module
    (``where``: its path) and both configs.

    Example::

        >>> ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
        ...     num_embeddings=8, feature_names=["f"])], device="meta")
        >>> sharder_override(ec, OptimizerConfig(learning_rate=0.1)).learning_rate
        0.1
    """
    if fused is None or module.optimizer_source != "optimizer=" or \
            module.optimizer_config == fused:
        return fused
    name = type(module).__name__ + (f" at {where!r}" if where else "")
    raise ValueError(f"{name}: optimizer={module.optimizer_config} conflicts with its "
                     f"sharder's fused_params, which configure {fused}; configure the "
                     f"optimizer in one place (the module's optimizer= or the sharder's "
                     f"fused_params)")


def sharded_optimizer(module, fused_params: Optional[Mapping[str, Any]],
                      where: Optional[str] = None) -> Optional[OptimizerConfig]:
    """The optimizer a sharder with ``fused_params`` gives ``module``'s share: what the marks
    of ``apply_optimizer_in_backward`` on the module's table parameters configure
    (``module.marked_fused_params()``) merged over ``fused_params`` key by key, the mark
    winning (TorchRec's ``merge_fused_params``), then checked against the module's own
    ``optimizer=`` (:func:`sharder_override`). None when neither configures one (the module
    keeps its own).

    Example::

        >>> from torchrec.optim import RowWiseAdagrad
        >>> from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        >>> ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
        ...     num_embeddings=8, feature_names=["f"])], device="meta")
        >>> apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
        >>> sharded_optimizer(ec, {"learning_rate": 0.5, "max_gradient": 2.0,
        ...                        "gradient_clipping": True}).max_gradient
        2.0
    """
    params = dict(checked_fused_params(fused_params) or {})
    marked = module.marked_fused_params()
    if marked is not None and module.optimizer_source == "optimizer=":
        config = fused_params_optimizer(marked)
        if config != module.optimizer_config:
            name = type(module).__name__ + (f" at {where!r}" if where else "")
            raise ValueError(f"{name}: apply_optimizer_in_backward marks {config} on the "
                             f"tables but the module trains with optimizer="
                             f"{module.optimizer_config}; configure the optimizer in one place")
    params.update(marked or {})
    return sharder_override(module, fused_params_optimizer(params), where)
