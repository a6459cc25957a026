"""GPU (marked): the torch engine on a CUDA device against the float64 oracle.

The engine's tile tables are built on the host and moved to the device; these tests check that the
device path gives the oracle's values in float64 and float32, forward and backward. They skip
cleanly where torch sees no CUDA device.
"""

import pytest
import torch
from common import Problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = {
    "dense-gqa": Problem(B=2, Hq=4, Hkv=2, Sq=113, Skv=97, D=40),
    "causal-br": Problem(B=2, Hq=2, Sq=37, Skv=113, D=72, causal="bottom_right"),
    "window": Problem(B=1, Hq=2, Sq=200, D=16, window=(17, 3)),
    "padding-causal": Problem(B=3, Hq=2, Sq=40, D=16, causal="bottom_right",
                              seq_lens_q=(40, 7, 1), seq_lens_kv=(40, 20, 2)),
    "na2d": Problem(B=1, Hq=2, Sq=63, D=16,
                    neighborhood=dict(spatial_shape=(7, 9), kernel_size=(3, 4), stride=(1, 2),
                                      dilation=(2, 1), is_causal=(False, True))),
    "bias-softcap": Problem(B=2, Hq=2, Sq=33, Skv=45, D=16, bias_shape=(1, 2, 33, 45),
                            softcap=5.0),
}


def _to_cuda(inp):
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_on_cuda_matches_oracle(name, dtype):
    p = CASES[name]
    inp = p.make_inputs(torch.float64, seed=3)
    ref, ref_lse = p.run_oracle(inp)
    dev = _to_cuda({k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()})
    out, lse = p.run_lib(dev, backend="torch")
    assert out.device == dev["q"].device
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_on_cuda_matches_oracle(name):
    p = CASES[name]
    inp = p.make_inputs(torch.float64, seed=4, requires_grad=True)
    ref, _ = p.run_oracle(inp)
    grads = [t for t in (inp["q"], inp["k"], inp["v"], inp["bias"]) if t is not None]
    g = torch.randn_like(ref)
    expected = torch.autograd.grad((ref * g).sum(), grads)
    dev = {k: (v.detach().cuda().requires_grad_(True) if isinstance(v, torch.Tensor) else v)
           for k, v in inp.items()}
    out, _ = p.run_lib(dev, backend="torch")
    got = torch.autograd.grad((out * g.cuda()).sum(),
                              [t for t in (dev["q"], dev["k"], dev["v"], dev["bias"]) if t is not None])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b, atol=1e-9, rtol=1e-9)
