"""Shared helpers for the test suite: a plain-data problem description that can be run both through
the library (translated into its public mask objects) and through the independent oracle."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path

import oracle
import torch

ATOL = {torch.float64: 1e-10, torch.float32: 1e-5}
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def qkv(B=2, H=2, Sq=5, D=4, *, Skv=None, Hkv=None, Dv=None, dtype=torch.float32, seed=0,
        layout="bhsd"):
    """Seeded random ``q, k, v`` (``[B, H, S, D]``, or ``[B, S, H, D]`` with ``layout="bshd"``):
    ``Skv``/``Hkv``/``Dv`` default to the query's. The one input builder the tests share."""
    g = torch.Generator().manual_seed(seed)
    Skv, Hkv, Dv = Sq if Skv is None else Skv, H if Hkv is None else Hkv, D if Dv is None else Dv
    shapes = ((B, H, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, Dv))
    out = tuple(torch.randn(*s, generator=g).to(dtype) for s in shapes)
    return out if layout == "bhsd" else tuple(t.transpose(1, 2) for t in out)


def ca():
    import cudnn_attn

    return cudnn_attn


def lib_mask(*, causal=None, window=None, neighborhood=None, seq_lens_q=None, seq_lens_kv=None):
    """Translate the oracle's plain mask description into the library's mask objects (AND-combined)."""
    lib = ca()
    parts = []
    if causal is not None:
        parts.append(lib.Causal(alignment=causal))
    if window is not None:
        align = window[2] if len(window) > 2 else "top_left"
        parts.append(lib.SlidingWindow(window[0], window[1], alignment=align))
    if neighborhood is not None:
        parts.append(lib.Neighborhood(**neighborhood))
    if seq_lens_q is not None or seq_lens_kv is not None:
        parts.append(lib.Padding(seq_lens_q, seq_lens_kv))
    if not parts:
        return None
    return functools.reduce(operator.and_, parts)


@dataclass
class Problem:
    """One attention problem, described with plain values."""

    B: int = 2
    Hq: int = 2
    Hkv: int | None = None
    Sq: int = 9
    Skv: int | None = None
    D: int = 16
    Dv: int | None = None
    causal: str | None = None
    window: tuple | None = None
    neighborhood: dict | None = None
    seq_lens_q: tuple | None = None
    seq_lens_kv: tuple | None = None
    bias_shape: tuple | None = None
    alibi: str | None = None  # None | "default" | "list" | "tensor_h" | "tensor_bh"
    softcap: float | None = None
    scale: float | None = None
    layout: str = "bhsd"
    id: str = field(default="", compare=False)

    def __post_init__(self):
        if self.Hkv is None:
            self.Hkv = self.Hq
        if self.neighborhood is not None:
            shape = self.neighborhood["spatial_shape"]
            S = math.prod(shape) if isinstance(shape, (tuple, list)) else shape
            self.Sq = S
            self.Skv = S
        if self.Skv is None:
            self.Skv = self.Sq
        if self.Dv is None:
            self.Dv = self.D

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    # -- inputs -------------------------------------------------------------------------------------
    def _shape(self, H, S, D):
        return (self.B, H, S, D) if self.layout == "bhsd" else (self.B, S, H, D)

    def make_inputs(self, dtype=torch.float64, seed=0, requires_grad=False):
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

        q = rnd(*self._shape(self.Hq, self.Sq, self.D))
        k = rnd(*self._shape(self.Hkv, self.Skv, self.D))
        v = rnd(*self._shape(self.Hkv, self.Skv, self.Dv))
        bias = rnd(*self.bias_shape) if self.bias_shape is not None else None
        slopes = None
        if self.alibi == "default":
            slopes = None
        elif self.alibi in ("list", "tensor_h"):
            slopes = (torch.rand(self.Hq, generator=g, dtype=torch.float64) * 0.5 + 0.05).tolist()
        elif self.alibi == "tensor_bh":
            slopes = torch.rand(self.B, self.Hq, generator=g, dtype=torch.float64) * 0.5 + 0.05
        if requires_grad:
            for t in (q, k, v, bias):
                if t is not None:
                    t.requires_grad_(True)
        return {"q": q, "k": k, "v": v, "bias": bias, "slopes": slopes}

    # -- library ------------------------------------------------------------------------------------
    def lib_mask(self):
        return lib_mask(
            causal=self.causal,
            window=self.window,
            neighborhood=self.neighborhood,
            seq_lens_q=self.seq_lens_q,
            seq_lens_kv=self.seq_lens_kv,
        )

    def lib_bias(self, inp):
        lib = ca()
        if self.alibi is not None:
            if self.bias_shape is not None:
                raise NotImplementedError("tensor bias and alibi together are not described by the contract")
            s = inp["slopes"]
            if self.alibi == "default":
                return lib.Alibi()
            if self.alibi == "list":
                return lib.Alibi(slopes=list(s))
            if self.alibi == "tensor_h":
                return lib.Alibi(slopes=torch.tensor(s, dtype=torch.float64))
            return lib.Alibi(slopes=s)
        return inp["bias"]

    def kwargs(self, inp):
        kw = {"mask": self.lib_mask(), "bias": self.lib_bias(inp), "layout": self.layout}
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        return kw

    def run_lib(self, inp, **extra):
        """(out, lse) from cudnn_attn.attention."""
        kw = self.kwargs(inp)
        kw.update(extra)
        res = ca().attention(inp["q"], inp["k"], inp["v"], return_lse=True, **kw)
        assert isinstance(res, tuple) and len(res) == 2, type(res)
        return res

    # -- oracle -------------------------------------------------------------------------------------
    def visibility(self):
        return oracle.build_visibility(
            self.B,
            self.Sq,
            self.Skv,
            causal=self.causal,
            window=self.window,
            neighborhood=self.neighborhood,
            seq_lens_q=self.seq_lens_q,
            seq_lens_kv=self.seq_lens_kv,
        )

    def alignment(self):
        if self.causal is not None:
            return self.causal
        if self.window is not None:
            return self.window[2] if len(self.window) > 2 else "top_left"
        return "top_left"

    def oracle_slopes(self, inp):
        if self.alibi is None:
            return None
        if self.alibi == "default":
            return oracle.default_alibi_slopes(self.Hq)
        return inp["slopes"]

    def oracle_alibi_bias(self, inp):
        if self.alibi is None:
            return None
        offs = oracle.aligned_offsets(
            self.B, self.Sq, self.Skv, self.alignment(), self.seq_lens_q, self.seq_lens_kv
        )
        return oracle.alibi_bias(self.oracle_slopes(inp), self.B, self.Hq, self.Sq, self.Skv, offs)

    def _run(self, attention_fn, inp):
        bias = inp["bias"]
        ab = self.oracle_alibi_bias(inp)
        if ab is not None:
            bias = ab if bias is None else bias + ab
        return attention_fn(inp["q"], inp["k"], inp["v"], self.visibility(), layout=self.layout,
                            scale=self.scale, softcap=self.softcap, bias=bias)

    def run_oracle(self, inp):
        """(out, lse) in float64 from the independent oracle (differentiable)."""
        return self._run(oracle.reference_attention, inp)

    def run_lowp_baseline(self, inp):
        """(out, lse) from plain PyTorch in the inputs' low precision (the tolerance baseline)."""
        return self._run(oracle.plain_lowp_attention, inp)


def assert_close(actual, expected, dtype, what=""):
    torch.testing.assert_close(
        actual.to(torch.float64),
        expected.to(torch.float64),
        atol=ATOL[dtype],
        rtol=RTOL[dtype],
        msg=lambda m: f"{what}: {m}",
    )


def check_forward(problem: Problem, dtype, seed=0):
    """Run the library and the oracle on the same inputs and compare out and lse."""
    inp = problem.make_inputs(dtype, seed)
    out, lse = problem.run_lib(inp)
    ref_out, ref_lse = problem.run_oracle(inp)
    assert out.dtype == dtype, f"out dtype {out.dtype} != {dtype}"
    assert out.shape == ref_out.shape, f"out shape {tuple(out.shape)} != {tuple(ref_out.shape)}"
    exp_lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == exp_lse_dtype, f"lse dtype {lse.dtype} != {exp_lse_dtype}"
    assert lse.shape == (problem.B, problem.Hq, problem.Sq), f"lse shape {tuple(lse.shape)}"
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    return inp, out, lse


def check_grads(problem: Problem, seed=0, atol=1e-9):
    """fp64 gradients of attention() vs autograd through the oracle (q, k, v and tensor bias)."""
    inp = problem.make_inputs(torch.float64, seed, requires_grad=True)
    out, _ = problem.run_lib(inp)
    ref, _ = problem.run_oracle(inp)
    g = torch.Generator().manual_seed(seed + 1000)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    names = [n for n in ("q", "k", "v", "bias") if inp[n] is not None]
    tensors = [inp[n] for n in names]
    got = torch.autograd.grad(out, tensors, dout, allow_unused=True)
    exp = torch.autograd.grad(ref, tensors, dout, allow_unused=True)
    for n, a, e in zip(names, got, exp):
        assert a is not None, f"no gradient for {n}"
        assert not torch.isnan(a).any(), f"NaN in d{n}"
        torch.testing.assert_close(a, e, atol=atol, rtol=1e-7, msg=lambda m, n=n: f"d{n}: {m}")


def load_script(path, module_name: str):
    """Import a script that is not a package module (an example, a benchmark) by its path."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported as ``bench_<name>``, with its folder on the path while
    it loads (the scripts import their siblings: ``_report``, ``proof_steps``, ...)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return load_script(Path(folder) / f"{name}.py", f"bench_{name}")
    finally:
        if folder in sys.path:  # a script may take its folder off the path itself
            sys.path.remove(folder)


def flash_attn_checkout(root: Path, tests_text: str) -> Path:
    """A stand-in FlashAttention checkout under ``root`` with ``tests_text`` as its
    ``tests/test_flash_attn.py`` (what ``tests/peer/run_flash_attn_suite.py`` reads)."""
    import pytest

    pytest.importorskip("einops")  # the runner needs it, as FlashAttention's tests do
    checkout = root / "flash-attention"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "flash_attn").mkdir()
    (checkout / "tests" / "test_flash_attn.py").write_text(tests_text)
    (checkout / "flash_attn" / "bert_padding.py").write_text("# FA's helpers\n")
    return checkout
