"""The fp16/bf16 oracle comparison shared by the 16-bit emulation tests and the mutation tests.

A 16-bit kernel output passes when, against the float64 oracle on the same (already rounded)
inputs:

* its largest error is at most ``ratio`` times that of a plain PyTorch computation entirely in
  the dtype (``oracle.plain_lowp_attention`` and its autograd): 2x forward, 3x backward;
* its rounding is unbiased: over the elements well away from zero, the mean of
  ``(|got| - |ref|) / ulp(ref)`` is within ``BIAS_LIMIT`` of 0. Round-to-nearest-even gives a mean
  near 0, truncation about -0.5 ulp, so a wrong conversion fails even when its error is small.
"""

from __future__ import annotations

import math

import torch

BIAS_LIMIT = 0.2
FRACTION_BITS = {torch.float16: 10, torch.bfloat16: 7}
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max()) if ref.numel() else 0.0


def rounding_bias(got: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[float, int]:
    """Mean of (|got| - |ref|) in ulps of ref, over elements above 1% of the largest; and their
    count."""
    ref = ref.detach().double().flatten()
    got = got.detach().double().flatten()
    keep = ref.abs() > 0.01 * ref.abs().max()
    ref, got = ref[keep], got[keep]
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs())) - FRACTION_BITS[dtype])
    return float(((got.abs() - ref.abs()) / ulp).mean()) if ref.numel() else 0.0, int(keep.sum())


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, dtype,
            ratio: float) -> list[str]:
    """Failures (empty when the output passes) of one 16-bit output."""
    failures = []
    if torch.isnan(got).any():
        return [f"{name}: NaN (an unwritten element?)"]
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = max_error(got, ref)
    base = max(max_error(baseline, ref), EPS[dtype] * scale, 1e-30)
    if err > ratio * base:
        failures.append(f"{name}: max error {err:.3g} is {err / base:.2f}x the plain "
                        f"{dtype} computation's {base:.3g} (limit {ratio}x)")
    bias, n = rounding_bias(got, ref, dtype)
    if n >= 200 and abs(bias) > BIAS_LIMIT:
        failures.append(f"{name}: rounding bias {bias:+.3f} ulp over {n} elements "
                        f"(round-to-nearest-even gives ~0)")
    return failures


def lse_failures(got: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """lse is fp32 in every dtype: close to the oracle's, -inf exactly where it is."""
    if torch.isnan(got).any():
        return ["lse: NaN"]
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(got) & (got < 0), inf):
        return ["lse: -inf pattern differs from the oracle"]
    err = max_error(got[~inf], ref[~inf])
    scale = float(ref[~inf].abs().max()) if (~inf).any() else 0.0
    return [] if err <= 1e-3 * max(1.0, scale) else [
        f"lse: max error {err:.3g}"]


def nan_like(*shape, dtype) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype)
