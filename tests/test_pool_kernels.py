"""The pooling kernel of DynamicEmbBagCollection against bags summed by hand, on both
backends: weights, MEAN, empty bags, features in their own columns of a wider output."""
import pytest
import torch

from dynemb.backends.numba_backends import get_backend


@pytest.mark.parametrize("mean,weighted", [(False, False), (False, True), (True, False)])
def test_pool_bags_writes_each_bag_into_its_columns(backend, mean, weighted):
    name, device = backend
    g = torch.Generator().manual_seed(1)
    dim, batch, features = 5, 3, 2
    weights = torch.randn(20, dim + 2, generator=g)  # optimizer state after the embedding
    lengths = torch.tensor([2, 0, 3, 1, 1, 0])  # bag q = feature * batch + sample
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    slots = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    scale = torch.rand(slots.numel(), generator=g) if weighted else torch.empty(0)
    cols = torch.tensor([4, 4 + dim])  # the table's features start at column 4
    out = torch.full((batch, 4 + features * dim + 1), 7.0)  # other columns must be kept
    expected = out.clone()
    for q in range(features * batch):
        f, b = divmod(q, batch)
        acc = torch.zeros(dim)
        for k in range(int(offsets[q]), int(offsets[q + 1])):
            acc += weights[slots[k], :dim] * (scale[k] if weighted else 1.0)
        if mean and lengths[q] > 0:
            acc /= float(lengths[q])
        expected[b, int(cols[f]):int(cols[f]) + dim] = acc
    args = [t.to(device) for t in (weights, slots, offsets, scale)]
    out = out.to(device)
    get_backend(name).pool_bags(*args, mean, batch, cols.to(device), dim, out)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)
    assert not expected[1, 4:4 + dim].any()  # an empty bag is zeros
