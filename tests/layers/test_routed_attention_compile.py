"""Routed window attention under torch.compile with the window changing between calls (the MSIT experts share one
module and pass their windows per call): torch.compile made the window a symbol and failed to lower the chunk
geometry derived from it ("Exponent must be non-negative"); each window is now a constant of its graph."""
import pytest
import torch

from moep_ds.layers.routed_attention import routed_window_attention


@pytest.mark.slow
def test_compiled_window_attention_with_changing_windows_equals_eager():
    torch._dynamo.reset()
    compiled = torch.compile(routed_window_attention)
    gen = torch.Generator().manual_seed(0)
    for N, window in ((40, 16), (50, 8), (30, 4), (45, 16)):
        q, k, v = (torch.randn(N, 2, 8, generator=gen) for _ in range(3))
        seq = torch.sort(torch.randint(0, 3, (N,), generator=gen)).values
        pos = torch.arange(N)
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v, seq, pos, window),
                                       routed_window_attention(q, k, v, seq, pos, window), rtol=1e-5, atol=1e-5)
