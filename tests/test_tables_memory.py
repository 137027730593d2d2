"""MemoryBreakdown adds up by category; storage_bytes counts each storage once."""
import torch

from dynemb.tables.memory import MemoryBreakdown, storage_bytes


def test_storage_bytes_counts_views_of_one_storage_once():
    a = torch.zeros(10, 4)                      # 160 bytes
    b = torch.zeros(3, dtype=torch.int64)       # 24 bytes
    assert storage_bytes([a, a[:, :2], a[5:], a.view(40), b]) == 160 + 24
    assert storage_bytes([a[:1]]) == 160        # a slice holds its whole storage
    assert storage_bytes([]) == 0
    # spans_only: what the views cover (a grouped table's rows, a view of its group's)
    assert storage_bytes([a[2:4], a[3:5], b[1:]], spans_only=True) == 3 * 16 + 16
    assert storage_bytes([a], spans_only=True) == 160


def test_breakdown_totals_and_sum():
    x = MemoryBreakdown(values_bytes=1, optimizer_bytes=2, hash_bytes=4, admission_bytes=8,
                        other_bytes=16, host_values_bytes=32, host_optimizer_bytes=64,
                        host_hash_bytes=128, host_other_bytes=256, in_flight_bytes=512)
    assert (x.device_bytes, x.host_bytes, x.total_bytes) == (31, 480, 511)  # not in flight
    y = x + MemoryBreakdown(values_bytes=1000, host_other_bytes=1000)
    assert (y.values_bytes, y.host_other_bytes, y.in_flight_bytes) == (1001, 1256, 512)
    assert y.total_bytes == 2511
