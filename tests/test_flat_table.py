"""FlatTable and RowLayout: where a row's embedding and optimizer state live, how rows start
(checked against the Python reference of the initializer streams), move and round."""
import pytest
import torch

from dynemb import Initializer, InitializerKind
from dynemb.rows.flat_table import FlatTable, RowLayout
from dynemb.rows.hash_table import ScoredHashTable
from key_reference import initial_rows

NORMAL = Initializer(InitializerKind.NORMAL, std=1.0)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(keys, dim, dtype=torch.float32, init=NORMAL, seed=1, table_id=0):
    keys = keys.tolist() if isinstance(keys, torch.Tensor) else keys
    return torch.tensor(initial_rows(init, keys, dim, seed=seed, table_id=table_id)).to(dtype)


# -- RowLayout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dim, state_dim, dtype, columns, width, row_bytes", [
    (64, 128, torch.float32, 64, 192, 192 * 4),          # Adam at dim 64
    (64, 128, torch.float16, 64, 64 + 256, 64 * 2 + 128 * 4),
    (5, 0, torch.float16, 5, 5, 10),                       # no state: no padding
    (5, 1, torch.bfloat16, 6, 6 + 2, 6 * 2 + 4),           # padded to even, float32 state
    (7, 14, torch.float16, 8, 8 + 28, 8 * 2 + 14 * 4),
])
def test_row_layout_sizes(dim, state_dim, dtype, columns, width, row_bytes):
    layout = RowLayout(dim, state_dim, dtype)
    assert (layout.embedding_columns, layout.width, layout.row_bytes) == (columns, width,
                                                                          row_bytes)
    assert layout.logical_width == dim + state_dim
    assert layout.embedding_bytes + layout.state_bytes == row_bytes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_row_keeps_a_float32_state_behind_the_padded_embedding(dtype):
    layout = RowLayout(3, 2, dtype)
    weights = torch.zeros(2, layout.width, dtype=dtype)
    layout.state(weights).copy_(torch.tensor([[1e-9, 3.0], [-2.5, 7e7]]))
    # columns 0..2 embedding, 3 padding, then each float32 takes the next two half columns
    as_float = weights.view(torch.float32)
    assert as_float[:, 2:].tolist() == [[pytest.approx(1e-9), 3.0], [-2.5, 7e7]]
    assert (weights[:, :4] == 0).all()
    logical = torch.tensor([[0.5, -1.0, 2.0, 1e-9, 3.0]])
    physical = layout.to_physical(logical)
    assert physical.dtype == dtype and physical.shape == (1, layout.width)
    assert torch.equal(layout.to_logical(physical), logical)


def test_bad_row_layout():
    with pytest.raises(TypeError, match="dtype must be one of"):
        RowLayout(4, 0, torch.int32)
    with pytest.raises(ValueError, match="dim"):
        RowLayout(0)


# -- FlatTable ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_initialize_writes_the_reference_rows_and_zero_state(backend, dtype):
    name, device = backend
    flat = FlatTable(16, dim=4, optimizer_state_dim=2, dtype=dtype, device=device, backend=name)
    flat.weights.fill_(5)  # whatever was there before
    slots = torch.tensor([3, 0, 9], device=device)
    keys = torch.tensor([100, -7, 2**62], device=device)
    flat.initialize(slots, keys, NORMAL, seed=1, table_id=0)
    assert torch.equal(flat.gather(slots).cpu(), reference(keys, 4, dtype))
    assert (flat.state[slots] == 0).all()
    assert (flat.weights[[1, 2, 4]] == 5).all()  # other rows untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_initialize_where_starts_only_masked_rows_with_a_slot(backend, dtype):
    name, device = backend
    flat = FlatTable(8, dim=3, optimizer_state_dim=1, dtype=dtype, device=device, backend=name)
    flat.weights.fill_(5)
    slots = torch.tensor([1, 4, -1, 6], device=device)
    keys = torch.tensor([10, 11, 12, 13], device=device)
    mask = torch.tensor([True, False, True, True], device=device)
    init = Initializer(InitializerKind.UNIFORM, low=-1.0, high=1.0)
    flat.initialize_where(slots, keys, mask, init, seed=3, table_id=9)
    got = flat.gather(torch.tensor([1, 6], device=device)).cpu()
    assert torch.equal(got, reference([10, 13], 3, dtype, init, seed=3, table_id=9))
    assert (flat.state[[1, 6]] == 0).all()
    untouched = [0, 2, 3, 4, 5, 7]  # slot 4 is not masked, key 12 has no slot
    assert (flat.weights[untouched] == 5).all()


def test_scatter_and_gather_with_state(backend):
    name, device = backend
    flat = FlatTable(8, dim=2, optimizer_state_dim=3, dtype=torch.bfloat16, device=device,
                     backend=name)
    slots = torch.tensor([5, 2], device=device)
    logical = torch.tensor([[1.0, -2.0, 1e-9, 2.0, 3.0], [0.5, 0.25, 4.0, 5.0, 6.0]])
    flat.scatter(slots, logical.to(device))
    assert torch.equal(flat.gather(slots, with_state=True).cpu(), logical)
    flat.scatter(slots[:1], torch.tensor([[7.0, 8.0]], device=device))  # embedding only
    assert flat.gather(slots, with_state=True).cpu()[0].tolist() == [
        7.0, 8.0, pytest.approx(1e-9), 2.0, 3.0]
    assert flat.gather(slots).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_follow_their_keys_through_growth(backend, dtype):
    name, device = backend
    table = ScoredHashTable(32, bucket_size=8, device=device, backend=name)
    flat = FlatTable(32, dim=4, optimizer_state_dim=2, dtype=dtype, device=device, backend=name)
    keys = torch.arange(100, 120, device=device)
    res = table.find_or_insert(keys)
    flat.initialize(res.slots, res.keys, NORMAL, seed=1, table_id=0)
    expected = reference(res.keys, 4, dtype)
    flat.scatter(res.slots[:2], torch.ones(2, 6, device=device))
    remap = table.grow(64)
    flat.remap(remap, 64)
    assert flat.capacity == 64
    moved = flat.gather(table.find(res.keys), with_state=True).cpu()
    assert (moved[:2] == 1).all()
    assert torch.equal(moved[2:, :4].to(dtype), expected[2:]) and (moved[2:, 4:] == 0).all()
    assert int((flat.weights != 0).any(1).sum()) == 20  # no row lost or duplicated


def test_bad_input():
    flat = FlatTable(8, dim=4)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 8\)"):
        flat.gather(torch.tensor([8]))
    with pytest.raises(ValueError, match="rows must have shape"):
        flat.scatter(torch.tensor([1]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="keys has shape"):
        flat.initialize(torch.tensor([1, 2]), torch.tensor([5]), NORMAL, seed=0, table_id=0)
    with pytest.raises(ValueError, match="remap has 4 entries"):
        flat.remap(torch.zeros(4, dtype=torch.int64), 16)
    with pytest.raises(TypeError, match="dtype must be one of"):
        FlatTable(8, dim=4, dtype=torch.int32)
    with pytest.raises(ValueError, match="dim must be positive"):
        FlatTable(8, dim=0)
