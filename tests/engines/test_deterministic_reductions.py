"""The torch engine's scattered sums are deterministic on every device (issue 23: the float32
RPB gradient differed between two identical backward calls on an H200).

torch lists ``index_add_``, ``scatter_add_``, ``index_put_(accumulate=True)`` and ``put_`` among
the operations that accumulate with atomics on CUDA; the neighborhood backward must call none of
them, run under ``torch.use_deterministic_algorithms(True)``, and still match the float64 brute
force (``na_oracle``).
"""

import na_oracle
import pytest
import torch

from cudnn_attn import neighborhood as N
from cudnn_attn.torch_engine.segments import add_at

ATOMIC = ["index_add", "index_add_", "scatter_add", "scatter_add_", "put_", "put",
          "scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_"]


@pytest.fixture
def atomics(monkeypatch):
    """Names of the ops called that accumulate with atomics on CUDA (patched on torch.Tensor and
    torch: autograd's backward does not pass through a TorchFunctionMode)."""
    seen = []

    def spy(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            seen.append(name)
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, call)

    for name in ATOMIC:
        for owner in (torch.Tensor, torch):
            if hasattr(owner, name):
                spy(owner, name)
    for owner in (torch.Tensor, torch):
        original = getattr(owner, "index_put_", None)
        if original is None:
            continue

        def put(*args, _original=original, **kwargs):
            if kwargs.get("accumulate") or (len(args) > 3 and args[3]):
                seen.append("index_put_(accumulate=True)")
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, "index_put_", put)
    return seen


def test_add_at_equals_index_add_with_repeated_indices(atomics):
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 7, (40,), generator=g)
    index[:5] = 3  # one target receives many sources; target 6 may receive none
    src = torch.randn(3, 40, 4, generator=g, dtype=torch.float64)
    acc = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
    want = acc.clone().index_add_(1, index, src)
    atomics.clear()
    got = add_at(acc.clone(), index, src)
    assert atomics == []
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert add_at(acc.clone(), index[:0], src[:, :0]).equal(acc)


@pytest.mark.parametrize("dims", [1, 2], ids=["na1d", "na2d"])
def test_rpb_backward_calls_no_atomic_op_and_matches_the_oracle(dims, atomics):
    shape, k, H = ((37,), 7, 2) if dims == 1 else ((9, 11), (3, 5), 2)
    g = torch.Generator().manual_seed(dims)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q64, k64, v64 = (rnd(2, *shape, H, 16) for _ in range(3))
    kernel = (k,) if dims == 1 else k
    rpb64 = rnd(H, *(2 * x - 1 for x in kernel))
    leaves = [t.float().requires_grad_(True) for t in (q64, k64, v64, rpb64)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (q64, k64, v64, rpb64)]
    na = N.na1d if dims == 1 else N.na2d
    dout = rnd(2, *shape, H, 16)
    grads = []
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        for _ in range(2):
            out = na(*leaves[:3], k, rpb=leaves[3])
            grads.append(torch.autograd.grad(out, leaves, dout.float()))
            assert atomics == [], f"ops that use atomics on CUDA: {sorted(set(atomics))}"
    finally:
        torch.use_deterministic_algorithms(previous)
    ref, _ = na_oracle.na_reference(*ref_leaves[:3], shape, k, rpb=ref_leaves[3])
    want = torch.autograd.grad(ref, ref_leaves, dout)
    for name, a, b, e in zip(["q", "k", "v", "rpb"], *grads, want):
        assert torch.equal(a, b), f"d{name}: two identical backward calls differ"
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=name: f"d{n}: {m}")
