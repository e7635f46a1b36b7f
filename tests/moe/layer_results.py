"""What the 2-process dispatch tests compare: one layer's output, input gradient and every parameter gradient of a
dispatch option against the blocking per-expert path's, on the same rank and inputs."""
import torch


def assert_same_results(got: dict, ref: dict, where: str, tol: float = 1e-6, reordered: bool = False) -> None:
    """`got` and `ref` as the workers save them: {"y", "x_grad", "grads": {name: tensor}}. `reordered`: the experts saw
    their rows in chunks, so a weight's gradient sums them in another order: within `tol` of its largest value."""
    close = dict(rtol=tol, atol=tol)
    torch.testing.assert_close(got["y"], ref["y"], **close, msg=f"{where} output")
    torch.testing.assert_close(got["x_grad"], ref["x_grad"], **close, msg=f"{where} input grad")
    assert got["grads"].keys() == ref["grads"].keys()
    for pname, grad in ref["grads"].items():
        assert grad is not None, (where, pname)
        scale = grad.abs().max().clamp_min(1e-30) if reordered else 1.0
        torch.testing.assert_close(got["grads"][pname] / scale, grad / scale, rtol=0 if reordered else tol, atol=tol,
                                   msg=f"{where} {pname}")
