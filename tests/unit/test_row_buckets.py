"""Row buckets of the packed linears (worker_svc/models/row_buckets.py): the bucket set and exactness."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker_svc.models.packed_linear import PackedLinear, can_pack
from worker_svc.models.row_buckets import RowBucketedLinear, bucket_linear_rows, bucket_rows, buckets_up_to


def test_buckets_are_few_and_pad_at_most_an_eighth():
    assert [bucket_rows(m) for m in (0, 1, 15, 16, 17, 18, 19, 33, 100, 129, 2047, 2048)] == \
        [0, 1, 15, 16, 18, 18, 20, 36, 104, 144, 2048, 2048]
    assert len(buckets_up_to(8192)) == 88 and len(buckets_up_to(2048)) == 72
    for m in range(1, 8193):
        b = bucket_rows(m)
        assert m <= b <= m * 1.125 and bucket_rows(b) == b  # a bucket is its own bucket


@pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [0, 1, 17, 300])
def test_padded_rows_give_the_unpadded_product(rows):
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
        linear.bias.copy_(torch.randn(96, generator=gen))
    x = torch.randn(rows, 64, generator=gen)
    got = RowBucketedLinear(PackedLinear(linear))(x)
    assert got.shape == (rows, 96)
    assert torch.allclose(got, linear(x), rtol=1e-5, atol=1e-5)
    batched = RowBucketedLinear(PackedLinear(linear))(x.view(1, rows, 64))  # leading dims kept
    assert batched.shape == (1, rows, 96) and torch.equal(batched[0], got)


def test_wrap_reaches_nested_modules_and_leaves_others():
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Sequential(nn.Linear(4, 8), nn.ReLU())})
    assert bucket_linear_rows(model, nn.Linear) == 2
    assert isinstance(model["a"], RowBucketedLinear) and isinstance(model["b"][0], RowBucketedLinear)
    assert isinstance(model["b"][1], nn.ReLU) and model["b"][0].weight.shape == (8, 4)


@pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="torch built without oneDNN")
def test_warm_up_runs_each_shape_once_per_bucket_within_its_limit(monkeypatch):
    from worker_svc.models.packed_linear import pack_linear_weights
    from worker_svc.models.row_buckets import warm_row_buckets

    model = nn.ModuleDict({"q": nn.Linear(8, 8), "k": nn.Linear(8, 8), "up": nn.Linear(8, 16, bias=False)})
    model.lm_head = nn.Linear(8, 32, bias=False)  # the logit rows' limit, not the step's
    pack_linear_weights(model)
    bucket_linear_rows(model, PackedLinear)
    seen: list[tuple[int, int]] = []
    real = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: seen.append((x.shape[0], self.out_features))
                        or real(self, x))
    assert warm_row_buckets(model, torch.float32, 40, 20) == 2 * len(buckets_up_to(40)) + len(buckets_up_to(20))
    assert sorted(r for r, out in seen if out == 8) == buckets_up_to(40)  # q and k share their shape
    assert sorted(r for r, out in seen if out == 16) == buckets_up_to(40)
    assert sorted(r for r, out in seen if out == 32) == buckets_up_to(20) == [*range(1, 17), 18, 20]
