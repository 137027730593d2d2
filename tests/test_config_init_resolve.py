"""Initial rows from the table's EmbeddingConfig, as TorchRec starts the table: its
weight_init range (default -+sqrt(1 / num_embeddings)) or an init_fn of torch.nn.init drawn
per id; other init_fns are refused at construction. Compared with TorchRec's own
EmbeddingCollection built from the same config, and with the Python row reference."""
import functools
import math

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig

from dynemb import (DynamicEmbTableOptions, Initializer, InitializerKind, OptimizerConfig,
                    OptimizerType)
from dynemb.rows.initializers import initializer_from_config
from dynemb.options import choose_storage_mode, resolve_initializer
from dynemb.tables import build_table
from key_reference import initial_rows
from table_builder import prefetch, rows_of

DIM = 8
ROWS = 4000


def config(**kw):
    kw.setdefault("num_embeddings", ROWS)
    return EmbeddingConfig(name="t", embedding_dim=DIM, feature_names=["f"], **kw)


def torchrec_weights(cfg) -> torch.Tensor:
    """The weights TorchRec's EmbeddingCollection starts ``cfg``'s table with."""
    torch.manual_seed(0)
    return EmbeddingCollection(tables=[cfg]).embeddings["t"].weight.detach().flatten()


def dynemb_rows(cfg, options=None, ids=None) -> torch.Tensor:
    """New rows of a table built from ``options`` settled against ``cfg``."""
    options = resolve_initializer(options or DynamicEmbTableOptions(), cfg)
    layout = choose_storage_mode(options, name="t", num_embeddings=cfg.num_embeddings,
                                 width=DIM, config_dtype=torch.float32)
    table = build_table("t", 99, DIM, layout, options, OptimizerConfig(OptimizerType.SGD),
                        torch.device("cpu"))
    ids = torch.arange(ROWS) * 7919 + 3 if ids is None else ids
    return rows_of(prefetch(table, ids))


def assert_same_distribution(ours, theirs, *, low=None, high=None):
    """Same range and moments (sample sizes of 32,000 values: a few percent of slack)."""
    ours = ours.flatten()
    if low is not None:
        assert float(ours.min()) >= low and float(theirs.min()) >= low
    if high is not None:
        assert float(ours.max()) <= high and float(theirs.max()) <= high
    spread = float(theirs.std())
    assert abs(float(ours.mean()) - float(theirs.mean())) < 0.05 * spread + 1e-12
    assert float(ours.std()) == pytest.approx(spread, rel=0.05, abs=1e-12)


# -- the range ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bounds", [
    dict(weight_init_min=-1.0, weight_init_max=1.0),      # BERT4Rec's
    dict(weight_init_min=-0.5),                           # max: TorchRec's default
    dict(),                                               # -+sqrt(1 / num_embeddings)
    dict(num_embeddings=10_000),                          # -+0.01
])
def test_the_weight_init_range_is_torchrecs(bounds):
    cfg = config(**bounds)
    low, high = cfg.get_weight_init_min(), cfg.get_weight_init_max()
    if not bounds or "num_embeddings" in bounds:
        assert high == -low == math.sqrt(1 / cfg.num_embeddings)
    init = initializer_from_config(cfg)
    assert (init.kind, init.low, init.high) == (InitializerKind.UNIFORM, low, high)
    rows = dynemb_rows(cfg)
    assert_same_distribution(rows, torchrec_weights(cfg), low=low, high=high)
    assert float(rows.min()) < low + 0.01 * (high - low)      # the whole range is used
    assert float(rows.max()) > high - 0.01 * (high - low)


def test_rows_are_drawn_per_id_as_the_python_reference_gives_them():
    cfg = config(weight_init_min=-1.0, weight_init_max=1.0)
    ids = torch.tensor([5, 2**40 + 1, -17, 5])
    rows = dynemb_rows(cfg, DynamicEmbTableOptions(seed=3), ids)
    want = initial_rows(Initializer(InitializerKind.UNIFORM, low=-1.0, high=1.0),
                        [5, 2**40 + 1, -17, 5], DIM, seed=3, table_id=99)
    torch.testing.assert_close(rows, torch.tensor(want), rtol=2e-7, atol=1e-7)


def test_equal_bounds_give_that_value_and_reversed_ones_are_refused_as_torchrec_does():
    cfg = config(weight_init_min=0.25, weight_init_max=0.25)
    assert (torchrec_weights(cfg) == 0.25).all()
    assert (dynemb_rows(cfg) == 0.25).all()
    reversed_bounds = config(weight_init_min=1.0, weight_init_max=-1.0)
    with pytest.raises(RuntimeError, match="range"):
        torchrec_weights(reversed_bounds)
    with pytest.raises(ValueError, match=r"table 't': weight_init_min \(1.0\) is above "
                                         r"weight_init_max \(-1.0\)"):
        resolve_initializer(DynamicEmbTableOptions(), reversed_bounds)


# -- init_fn -----------------------------------------------------------------------------------
@pytest.mark.parametrize("init_fn, kind, low, high", [
    (functools.partial(torch.nn.init.uniform_, a=-0.3, b=0.1), InitializerKind.UNIFORM,
     -0.3, 0.1),
    (functools.partial(torch.nn.init.normal_, mean=0.1, std=0.02), InitializerKind.NORMAL,
     None, None),
    (functools.partial(torch.nn.init.trunc_normal_, mean=0.0, std=0.05, a=-0.06, b=0.04),
     InitializerKind.TRUNCATED_NORMAL, -0.06, 0.04),
    (functools.partial(torch.nn.init.trunc_normal_, std=0.02), InitializerKind.TRUNCATED_NORMAL,
     -2.0, 2.0),
])
def test_a_torch_init_fn_is_drawn_per_id_with_its_distribution(init_fn, kind, low, high):
    cfg = config(init_fn=init_fn)
    assert initializer_from_config(cfg).kind is kind
    assert_same_distribution(dynemb_rows(cfg), torchrec_weights(cfg), low=low, high=high)


@pytest.mark.parametrize("init_fn, value", [
    (functools.partial(torch.nn.init.constant_, val=0.5), 0.5), (torch.nn.init.zeros_, 0.0),
    (torch.nn.init.ones_, 1.0)])
def test_constant_init_fns(init_fn, value):
    cfg = config(init_fn=init_fn)
    assert (torchrec_weights(cfg) == value).all()
    assert (dynemb_rows(cfg) == value).all()


@pytest.mark.parametrize("init_fn", [
    torch.nn.init.xavier_uniform_, functools.partial(torch.nn.init.kaiming_normal_, a=0.1),
    lambda w: w.data.fill_(0.1)])
def test_an_init_fn_that_cannot_run_per_id_is_refused_naming_the_supported_way(init_fn):
    cfg = config(init_fn=init_fn)
    with pytest.raises(ValueError, match=(
            r"table 't': init_fn .* cannot start the rows of a dynamic table.*uniform_, "
            r"normal_, trunc_normal_, constant_, zeros_, ones_.*weight_init_min / "
            r"weight_init_max.*DynamicEmbTableOptions\(initializer=Initializer\(\.\.\.\)\)")):
        resolve_initializer(DynamicEmbTableOptions(), cfg)
    # the supported way: an explicit initializer, which the config does not override
    explicit = Initializer(InitializerKind.NORMAL, std=0.1)
    options = resolve_initializer(DynamicEmbTableOptions(initializer=explicit), cfg)
    assert options.initializer is explicit


def test_positional_arguments_that_would_take_the_weights_place_are_refused():
    # TorchRec calls init_fn(weight): a partial's positional arguments come first
    cfg = config(init_fn=functools.partial(torch.nn.init.uniform_, -0.2, 0.2))
    with pytest.raises(AttributeError):
        torchrec_weights(cfg)
    with pytest.raises(ValueError, match=r"table 't': init_fn .* would get the weight tensor "
                                         r"after its positional arguments.*by keyword"):
        resolve_initializer(DynamicEmbTableOptions(), cfg)


def test_a_generator_is_refused_naming_the_seed():
    cfg = config(init_fn=functools.partial(torch.nn.init.normal_, std=0.1,
                                           generator=torch.Generator()))
    with pytest.raises(ValueError, match=r"torch.Generator.*DynamicEmbTableOptions\(seed=\.\.\.\)"):
        resolve_initializer(DynamicEmbTableOptions(), cfg)


# -- the options ---------------------------------------------------------------------------------
def test_initializer_defaults_to_the_config_and_an_explicit_one_wins():
    assert DynamicEmbTableOptions().initializer is None
    cfg = config(weight_init_min=-1.0, weight_init_max=1.0)
    explicit = Initializer(InitializerKind.CONSTANT, value=0.5)
    assert (dynemb_rows(cfg, DynamicEmbTableOptions(initializer=explicit)) == 0.5).all()
    with pytest.raises(TypeError, match=r"initializer must be an Initializer or None"):
        DynamicEmbTableOptions(initializer="uniform")


def test_a_table_built_from_unsettled_options_starts_from_the_default_initializer():
    options = DynamicEmbTableOptions()
    layout = choose_storage_mode(options, name="t", num_embeddings=64, width=DIM,
                                 config_dtype=torch.float32)
    table = build_table("t", 5, DIM, layout, options, OptimizerConfig(OptimizerType.SGD),
                        torch.device("cpu"))
    assert table.options.initializer == Initializer()
    rows = rows_of(prefetch(table, torch.tensor([11, 12])))
    want = initial_rows(Initializer(), [11, 12], DIM, seed=0, table_id=5)
    torch.testing.assert_close(rows, torch.tensor(want), rtol=2e-7, atol=1e-7)
