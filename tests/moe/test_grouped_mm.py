import pytest
import torch

from moep_ds.moe import grouped_mm as gm


def reference(x, w, counts):
    return torch.cat([x_e @ w[e] for e, x_e in enumerate(x.split(counts))])


@pytest.mark.parametrize("counts", [[3, 0, 4, 1], [2, 2, 2, 2], [0, 0, 0, 0]], ids=["uneven", "equal", "empty"])
@pytest.mark.parametrize("path", ["loop", "bmm"])
def test_grouped_mm_matches_per_expert_matmuls(counts, path, monkeypatch):
    if path == "bmm":  # the accelerator path, exercised on CPU
        monkeypatch.setattr(gm, "use_bmm", lambda x, c: len(set(c)) == 1)
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(counts), 3, dtype=torch.float64)
    y = gm.grouped_mm(x, w, counts)
    ref = reference(x, w, counts)
    torch.testing.assert_close(y, ref)
    ours = torch.autograd.grad((y * g).sum(), [x, w])
    expected = torch.autograd.grad((ref * g).sum(), [x, w])
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b)
    if sum(counts):
        assert torch.autograd.gradcheck(lambda x_, w_: gm.grouped_mm(x_, w_, counts), (x, w))


def test_grouped_mm_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"counts \[1, 1\] do not split 3 rows over 2 experts"):
        gm.grouped_mm(torch.randn(3, 2), torch.randn(2, 2, 2), [1, 1])
