"""``cudnn_attn.use_backend`` / ``exclude_backend`` and ``CUDNN_ATTN_BACKENDS`` /
``CUDNN_ATTN_EXCLUDE_BACKENDS``: honoured by every surface, per thread, and by compiled code at
each call. On this CPU only the torch engine is available, so "honoured" is shown two ways: with
the torch engine excluded every surface refuses (NotSupportedError naming the policy), and with
the fake cuDNN engine (``cudnn_fake``) installed the policy moves calls between two engines that
both can run them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import NotSupportedError, dispatch

F64 = torch.float64


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _attention():
    q, k, v = _t(1, 2, 5, 8), _t(1, 2, 5, 8, seed=1), _t(1, 2, 5, 8, seed=2)
    return ca.attention(q, k, v, mask=ca.Causal())


def _varlen():
    x = _t(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return ca.attention_varlen(x, x, x, cu, cu, 4, 4)


def _flash_attn_func():
    from cudnn_attn.flash_attn_interface import flash_attn_func
    x = _t(1, 5, 2, 8)
    return flash_attn_func(x, x, x, causal=True)


def _flash_attn_varlen_func():
    from cudnn_attn.flash_attn_interface import flash_attn_varlen_func
    x = _t(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return flash_attn_varlen_func(x, x, x, cu, cu, 4, 4, causal=True)


def _flash_attn_private():
    from cudnn_attn.flash_attn_interface import _flash_attn_forward
    x = _t(1, 5, 2, 8)
    return _flash_attn_forward(x, x, x, 0.0, 0.3, True, -1, -1, 0.0, None, False)[0]


def _mha_fwd():
    from cudnn_attn.flash_api import mha_fwd
    x = _t(1, 5, 2, 8)
    return mha_fwd(x, x, x, None, None, 0.0, 0.3, False, -1, -1, 0.0, False, None)[0]


def _natten():
    from cudnn_attn import neighborhood as na
    x = _t(1, 9, 2, 8)
    return na.na1d(x, x, x, kernel_size=3)


def _builder():
    attrs = ca.SdpaAttributes().set_causal_mask(True).set_attn_scale(0.3)
    x = _t(1, 2, 5, 8)
    return ca.scaled_dot_product_flash_attention(x, x, x, attrs)[0]


def _module():
    from cudnn_attn.nn import MultiheadAttention
    torch.manual_seed(0)  # the same weights each time
    mha = MultiheadAttention(8, 2).double()
    x = _t(1, 5, 8)
    out = mha(x, x, x)
    return out[0] if isinstance(out, tuple) else out


SURFACES = {f.__name__.lstrip("_"): f for f in (
    _attention, _varlen, _flash_attn_func, _flash_attn_varlen_func, _flash_attn_private,
    _mha_fwd, _natten, _builder, _module)}


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_surface_refuses_an_excluded_engine(surface):
    fn = SURFACES[surface]
    want = fn()
    with ca.exclude_backend("torch"):
        with pytest.raises(NotSupportedError, match=r"excluded by cudnn_attn\.exclude_backend"):
            fn()
        with ca.use_backend("torch"):  # the innermost use_backend re-allows it
            torch.testing.assert_close(fn(), want)
    torch.testing.assert_close(fn(), want)  # and the policy ends with the block


def test_explain_names_the_policy_and_forced_backends_obey_it():
    q = _t(1, 2, 4, 8)
    with ca.use_backend(["cupy"]):
        verdicts = ca.explain(q, q, q)
        assert verdicts.selected is None
        assert verdicts["torch"] == ["excluded by cudnn_attn.use_backend(['cupy'])"]
        with pytest.raises(NotSupportedError, match="backend='torch' cannot run"):
            ca.attention(q, q, q, backend="torch")  # an explicit backend is no way around it
    assert ca.explain(q, q, q).selected == "torch"


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="'tpu'"):
        ca.use_backend("tpu")
    with pytest.raises(TypeError, match="backends must be"):
        ca.exclude_backend(3)
    with pytest.raises(TypeError, match="backends must be"):
        ca.use_backend([])


def test_policy_moves_calls_between_two_engines(monkeypatch):
    import cudnn_fake
    if not cudnn_fake.frontend_present():
        pytest.skip("needs the cuDNN frontend for the fake cuDNN engine")
    _, built = cudnn_fake.install(monkeypatch)
    q = _t(1, 2, 6, 8).half()  # cuDNN takes 16-bit inputs
    want = ca.attention(q, q, q, mask=ca.Causal(), backend="torch")
    assert ca.explain(q, q, q, mask=ca.Causal()).selected == "cudnn"
    ca.attention(q, q, q, mask=ca.Causal())
    assert len(built) == 1
    with ca.exclude_backend("cudnn"):
        assert ca.explain(q, q, q, mask=ca.Causal()).selected == "torch"
        torch.testing.assert_close(ca.attention(q, q, q, mask=ca.Causal()), want, atol=2e-3, rtol=0)
        assert len(built) == 1  # the cached call did not carry the cudnn plan into the block
        with ca.use_backend("cudnn"):
            torch.testing.assert_close(ca.attention(q, q, q, mask=ca.Causal()), want, atol=2e-3,
                                       rtol=0)
    with ca.use_backend("torch"):
        from cudnn_attn.flash_attn_interface import flash_attn_func
        x = q.transpose(1, 2)
        flash_attn_func(x, x, x, causal=True)
    assert len(built) == 1


def test_policy_is_per_thread():
    barrier = threading.Barrier(2, timeout=30)
    seen = {}

    def excluded():
        with ca.exclude_backend("torch"):
            barrier.wait()          # the other thread runs while this one is inside the block
            barrier.wait()
            try:
                _attention()
            except NotSupportedError:
                seen["excluded"] = "refused"

    def plain():
        barrier.wait()
        seen["plain"] = (dispatch.allowed_backends(), _attention().shape)
        barrier.wait()

    threads = [threading.Thread(target=excluded), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"excluded": "refused", "plain": (dispatch.BACKEND_NAMES, (1, 2, 5, 8))}


def test_compiled_code_honours_the_policy_at_each_call():
    torch._dynamo.reset()

    def f(q, k, v):
        return ca.attention(q, k, v, mask=ca.Causal()) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = _t(1, 2, 5, 8), _t(1, 2, 5, 8, seed=1), _t(1, 2, 5, 8, seed=2)
    want = compiled(q, k, v)
    torch.testing.assert_close(want, f(q, k, v))
    with ca.exclude_backend("torch"):
        with pytest.raises(NotSupportedError, match="excluded by"):
            compiled(q, k, v)
    torch.testing.assert_close(compiled(q, k, v), want)


def _import_with(env: dict) -> subprocess.CompletedProcess:
    code = ("import torch, cudnn_attn as ca; q = torch.zeros(1, 1, 2, 4);"
            "print(ca.explain(q, q, q)['torch'])")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_environment_variables_set_the_default_policy():
    res = _import_with({"CUDNN_ATTN_BACKENDS": "cudnn, cupy"})
    assert "excluded by the environment (CUDNN_ATTN_BACKENDS=cudnn, cupy)" in res.stdout, res.stderr
    res = _import_with({"CUDNN_ATTN_EXCLUDE_BACKENDS": "torch"})
    assert "CUDNN_ATTN_EXCLUDE_BACKENDS=torch" in res.stdout, res.stderr
    res = _import_with({"CUDNN_ATTN_BACKENDS": "torch,gpu"})
    assert res.returncode != 0 and "CUDNN_ATTN_BACKENDS must name backends" in res.stderr
