"""examples/dlrm_data.py: the Criteo / MovieLens reader and the synthetic Criteo writer, checked
against an independent line-by-line parse of small files."""
import gzip
import math

import numpy as np
import pytest
import torch

from examples.dlrm_data import (CRITEO_SPARSE_NAMES, RESERVED_IDS, BatchReader, MalformedLineError,
                                _avoid_reserved, hash_string, hash_strings, held_out_mask,
                                write_synthetic_criteo)

FNV_OFFSET, FNV_PRIME = 14695981039346656037, 1099511628211


def fnv1a64_signed(text: str) -> int:
    """64-bit FNV-1a of the ASCII bytes, as a signed int64: the reader's hash, written plainly."""
    h = FNV_OFFSET
    for byte in text.encode("ascii"):
        h = ((h ^ byte) * FNV_PRIME) % 2 ** 64
    return h - 2 ** 64 if h >= 2 ** 63 else h


def parse_criteo_line(line: str):
    """One Criteo line, parsed plainly: label, 13 transformed dense values, 26 ids or None."""
    fields = line.rstrip("\n").split("\t")
    assert len(fields) == 40
    dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]]
    ids = [fnv1a64_signed(c) if c else None for c in fields[14:]]
    return float(fields[0]), dense, ids


def first_ids(batch):
    """Per sample, the id of each Criteo feature, None for an empty bag (bags hold <= 1 id)."""
    columns = []
    for name in CRITEO_SPARSE_NAMES:
        jagged = batch.sparse[name]
        lengths, values = jagged.lengths().tolist(), iter(jagged.values().tolist())
        assert max(lengths) <= 1
        columns.append([next(values) if n else None for n in lengths])
    return [list(row) for row in zip(*columns)]


def criteo_line(label="1", dense=None, cats=None):
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats]) + "\n"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("dlrm") / "synthetic.tsv"
    summary = write_synthetic_criteo(path, rows=3000, seed=7)
    return path, summary


def test_hash_is_fixed_fnv1a():
    """A hard-coded id, an independent expression, and the vectorised form agree."""
    assert hash_string("68fd1e64") == 1938573664431018461
    assert fnv1a64_signed("68fd1e64") == 1938573664431018461
    for text in ("0", "a", "A", "0a", "ffffffffffffffff", "1d0b14e4db018fed"):
        assert hash_string(text) == fnv1a64_signed(text)
    values = np.array([b"68fd1e64", b"", b"a", b"ffffffffffffffff"])
    empty = FNV_OFFSET - 2 ** 64                     # no byte hashed: the offset basis
    assert hash_strings(values).tolist() == [fnv1a64_signed(v.decode()) if v else empty
                                             for v in values.tolist()]
    assert hash_strings(values.reshape(2, 2)).shape == (2, 2)


def test_reserved_ids_are_remapped():
    ids = np.array([RESERVED_IDS[0], RESERVED_IDS[1], RESERVED_IDS[1] + 1, 0, -1, 2 ** 63 - 1],
                   dtype=np.int64)
    out = _avoid_reserved(ids.copy())
    assert out.tolist() == [-(2 ** 63) + 2, -(2 ** 63) + 3, -(2 ** 63) + 2, 0, -1, 2 ** 63 - 1]


def test_synthetic_round_trip(synthetic):
    """Every row the reader yields equals an independent parse of the written line."""
    path, summary = synthetic
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == summary.rows == 3000
    expected = [parse_criteo_line(line) for line in lines]
    reader = BatchReader(path, batch_size=256, split="all", chunk_lines=700)
    got_labels, got_dense, got_ids = [], [], []
    for batch in reader:
        assert batch.sparse.keys() == list(CRITEO_SPARSE_NAMES)
        assert batch.sparse.values().dtype == torch.int64
        assert batch.dense.shape[1] == 13 and batch.dense.dtype == torch.float32
        got_labels += batch.labels.tolist()
        got_dense += batch.dense.tolist()
        got_ids += first_ids(batch)
    assert reader.rows == 3000 and reader.skipped_lines == 0
    assert got_labels == [e[0] for e in expected]
    np.testing.assert_allclose(got_dense, [e[1] for e in expected], rtol=1e-6)
    assert got_ids == [e[2] for e in expected]


def test_synthetic_file_has_the_promised_shape(synthetic, tmp_path):
    """Missing values, negatives, 8- and 16-digit hex ids, Zipf repeats, learnable labels,
    and the same bytes for the same seed."""
    path, summary = synthetic
    rows = [line.rstrip("\n").split("\t") for line in path.read_text().splitlines()]
    dense = [r[1:14] for r in rows]
    cats = [r[14:] for r in rows]
    assert any(x == "" for r in dense for x in r)
    assert any(x.startswith("-") for r in dense for x in r)
    assert any(c == "" for r in cats for c in r)
    assert {len(c) for r in cats for c in r} == {0, 8, 16}
    first = [r[0] for r in cats]
    assert max(first.count(v) for v in set(first)) > len(first) / 20    # popular values repeat
    assert 0.1 < summary.positive_rate < 0.5
    assert 0.75 < summary.bayes_auc < 0.95
    again = write_synthetic_criteo(tmp_path / "again.tsv", rows=3000, seed=7)
    assert (tmp_path / "again.tsv").read_bytes() == path.read_bytes()
    assert again.bayes_auc == summary.bayes_auc


def test_missing_values(tmp_path):
    dense = ["", "-5", "0", "7"] + [""] * 9
    cats = ["", "68fd1e64"] + [""] * 23 + ["ABC"]
    path = tmp_path / "missing.tsv"
    path.write_text(criteo_line("0", dense, cats) + criteo_line("1"))
    batch, = BatchReader(path, batch_size=8, split="all")
    assert batch.labels.tolist() == [0.0, 1.0]
    assert batch.dense[0].tolist()[:4] == [0.0, 0.0, 0.0, pytest.approx(math.log(8))]
    lengths = batch.sparse.lengths().view(26, 2)               # feature-major
    assert lengths[:, 0].tolist() == [0, 1] + [0] * 23 + [1]
    assert lengths[:, 1].tolist() == [1] * 26
    per_feature = batch.sparse.to_dict()
    assert per_feature["cat_1"].values().tolist() == [fnv1a64_signed("68fd1e64"),
                                                      fnv1a64_signed("00000001")]
    assert per_feature["cat_25"].values()[0].item() == fnv1a64_signed("ABC")


MALFORMED = {  # kind: (line, what the error says)
    "field count": (criteo_line()[:-1] + "\textra\n", "expected 40 tab-separated fields"),
    "dense not an integer": (criteo_line(dense=["1.5"] + ["0"] * 12), "I1 = '1.5'"),
    "dense with underscore": (criteo_line(dense=["0"] * 5 + ["1_0"] + ["0"] * 7), "I6 = '1_0'"),
    "dense too long": (criteo_line(dense=["1" * 19] + ["0"] * 12), "not a valid integer"),
    "categorical not hex": (criteo_line(cats=["0"] * 7 + ["xyz"] + ["0"] * 18), "C8 = 'xyz'"),
    "categorical too long": (criteo_line(cats=["f" * 17] + ["0"] * 25), "not a valid hex"),
    "label not 0/1": (criteo_line(label="2"), "label '2' is not 0 or 1"),
    "label empty": (criteo_line(label=""), "is not 0 or 1"),
    "blank line": ("\n", "expected 40"),
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_line_raises_with_its_number(tmp_path, kind):
    path = tmp_path / "bad.tsv"
    good = criteo_line()
    line, reason = MALFORMED[kind]
    path.write_text(good * 5 + line + good * 3)
    with pytest.raises(MalformedLineError) as err:
        list(BatchReader(path, batch_size=4, split="all", chunk_lines=4))
    assert err.value.line == 6 and err.value.path == str(path)
    assert f"{path}:6:" in str(err.value) and reason in err.value.reason


def test_malformed_lines_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "bad.tsv"
    lines = [criteo_line(label=str(i % 2)) for i in range(20)]
    bad_at = [2, 7, 8, 15]                                          # 0-based
    for i, kind in zip(bad_at, ["field count", "dense not an integer", "categorical not hex",
                                "label not 0/1"]):
        lines[i] = MALFORMED[kind][0]
    path.write_text("".join(lines))
    reader = BatchReader(path, batch_size=3, split="all", chunk_lines=6, skip_malformed=True)
    labels = [x for batch in reader for x in batch.labels.tolist()]
    assert reader.skipped_lines == 4 and reader.rows == 16
    assert [line for line, _ in reader.skipped_examples] == [i + 1 for i in bad_at]
    assert reader.skipped_examples[1][1] == "I1 = '1.5' is not a valid integer"
    assert labels == [float(i % 2) for i in range(20) if i not in bad_at]
    assert "skipped 4 malformed lines" in caplog.text


def test_held_out_split_is_disjoint_deterministic_and_complete(synthetic):
    path, _ = synthetic
    lines = path.read_text().splitlines(keepends=True)

    def labels_and_first_dense(split, chunk_lines, batch_size):
        out = []
        for batch in BatchReader(path, batch_size=batch_size, split=split, eval_fraction=0.2,
                                 chunk_lines=chunk_lines):
            out += list(zip(batch.labels.tolist(), batch.dense[:, 1].tolist(),
                            first_ids(batch)))
        return out

    held = held_out_mask(np.arange(1, len(lines) + 1), 0.2)
    assert 0.15 < held.mean() < 0.25
    everything = labels_and_first_dense("all", 1000, 500)
    train = labels_and_first_dense("train", 333, 64)
    evaluation = labels_and_first_dense("eval", 1000, 100)
    assert len(train) + len(evaluation) == len(everything) == len(lines)
    assert train == [r for r, h in zip(everything, held) if not h]
    assert evaluation == [r for r, h in zip(everything, held) if h]
    assert held_out_mask(np.arange(1, 11), 0.2).tolist() == held[:10].tolist()
    assert held_out_mask(np.arange(1, 11), 0.0).sum() == 0
    assert held_out_mask(np.arange(1, 11), 1.0).all()


@pytest.mark.parametrize("drop_last", [False, True])
def test_batching_covers_every_row_once(synthetic, drop_last):
    path, _ = synthetic
    sizes = [len(b.labels) for b in BatchReader(path, batch_size=128, split="all", chunk_lines=1000,
                                                drop_last=drop_last)]
    assert all(s == 128 for s in sizes[:-1])
    assert sum(sizes) == (3000 // 128 * 128 if drop_last else 3000)
    shares = [[b.labels for b in BatchReader(path, batch_size=128, split="all", chunk_lines=1000,
                                             rank=r, world_size=3)] for r in range(3)]
    assert [len(s) for s in shares] == [8, 8, 8]
    whole = torch.cat([b.labels for b in BatchReader(path, batch_size=128, split="all")])
    interleaved = [shares[i % 3][i // 3] for i in range(24)]
    assert torch.equal(torch.cat(interleaved), whole)


def test_gzip_and_progress(synthetic, tmp_path):
    path, _ = synthetic
    packed = tmp_path / "synthetic.tsv.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    a = torch.cat([b.dense for b in BatchReader(path, batch_size=1000, split="all")])
    b = torch.cat([b.dense for b in BatchReader(packed, batch_size=1000, split="all",
                                                progress=True)])
    assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["dat", "csv"])
def test_movielens(tmp_path, form):
    rows = [(1, 1193, "5", 978300760), (1, 661, "3", 978302109), (6040, 3952, "4", 0),
            (22, 7, "3.5", 86400 * 4 + 3600 * 13)]
    path = tmp_path / ("ratings.dat" if form == "dat" else "ratings.csv")
    if form == "dat":
        text = "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows)
    else:
        text = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n"
                                                                for u, i, r, t in rows)
    path.write_text(text)
    batch, = BatchReader(path, batch_size=10, format="movielens", split="all")
    assert batch.labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    features = batch.sparse.to_dict()
    assert batch.sparse.keys() == ["user", "item"]
    assert features["user"].values().tolist() == [1, 1, 6040, 22]
    assert features["item"].values().tolist() == [1193, 661, 3952, 7]
    assert features["user"].lengths().tolist() == [1, 1, 1, 1]
    # hour / 23 and weekday / 6 (UTC; 1970-01-01 was a Thursday, Monday = 0)
    assert batch.dense[2].tolist() == [0.0, pytest.approx(3 / 6)]
    assert batch.dense[3].tolist() == [pytest.approx(13 / 23), pytest.approx(0 / 6)]

    bad = path.with_name("bad_" + path.name)
    separator = "::" if form == "dat" else ","
    bad.write_text(text + separator.join(["5", "x1", "4", "0"]) + "\n"
                   + separator.join(["5", "1", "good", "0"]) + "\n")
    header = 1 if form == "csv" else 0
    with pytest.raises(MalformedLineError) as err:
        list(BatchReader(bad, batch_size=10, format="movielens", split="all"))
    assert err.value.line == 5 + header and "item" in err.value.reason
    reader = BatchReader(bad, batch_size=10, format="movielens", split="all", skip_malformed=True)
    assert sum(len(b.labels) for b in reader) == 4 and reader.skipped_lines == 2
    assert "rating" in reader.skipped_examples[1][1]


def test_bad_arguments(tmp_path, synthetic):
    path, _ = synthetic
    with pytest.raises(FileNotFoundError):
        BatchReader(tmp_path / "nowhere.tsv", batch_size=4)
    with pytest.raises(ValueError, match="split"):
        BatchReader(path, batch_size=4, split="test")
    with pytest.raises(ValueError, match="rank"):
        BatchReader(path, batch_size=4, rank=2, world_size=2)
    with pytest.raises(ValueError):
        BatchReader(path, batch_size=4, format="parquet")
