"""GPU rows of ``benchmarks/cudnn.py``: the host time of a tiny packed (varlen) call, ours
against torch's padded call as its users write it (issue 35).

The problem: two sequences of 100 and 28 tokens, 8 heads, D = 64, bf16, causal; packed
``[128, 8, 64]`` with device offsets for ours, a ``[2, 8, 100, 64]`` batch with the boolean mask
made from the lengths per call for torch. Microseconds per call, back to back (one
synchronisation per batch of calls; the GPU work is a few microseconds, so the host sets the
pace):

  tiny varlen fwd: ours                  ``attention_varlen`` (the ragged graph, offsets never read)
  tiny varlen fwd+bwd: flash_attn_varlen_func   FlashAttention's function, forward and
                                         ``torch.autograd.grad`` (Hugging Face's padded path)
  tiny varlen fwd / fwd+bwd: torch-<backend>    torch SDPA on the padded batch, cuDNN and
                                         efficient backends (one that cannot run it is left out)

``vs_torch_cudnn``: ours over torch's padded call of the same direction (cuDNN backend, else
efficient).
"""

from __future__ import annotations

import torch

LENGTHS = (100, 28)
HEADS, DIM = 8, 64


def padded_mask(positions: torch.Tensor, lengths: torch.Tensor, below=None) -> torch.Tensor:
    """torch SDPA's boolean ``attn_mask`` ``[B, 1, S, S]`` as its users make it from the lengths
    at every call: both tokens within their sequence (and, with ``below``, a ``[S, S]`` causal
    mask, the key not after the query). The peer rows of ``cudnn.py`` and ``cudnn_host.py``."""
    keep = positions[None, :] < lengths[:, None]  # [B, S]: a token or padding
    allowed = keep[:, None, :, None] & keep[:, None, None, :]
    return allowed if below is None else below & allowed


def calls(device, dtype=torch.bfloat16) -> dict:
    """label -> a callable of one call (ours and torch's), on ``device``."""
    import cudnn_attn as ca
    from cudnn_attn.flash_attn_interface import flash_attn_varlen_func
    from cudnn_attn.varlen import attention_varlen

    g = torch.Generator(device=device).manual_seed(0)
    total, longest = sum(LENGTHS), max(LENGTHS)
    q, k, v = (torch.randn(total, HEADS, DIM, device=device, dtype=dtype, generator=g)
               .requires_grad_(True) for _ in range(3))
    dout = torch.randn(total, HEADS, DIM, device=device, dtype=dtype, generator=g)
    offsets = torch.tensor([0, LENGTHS[0], total], device=device, dtype=torch.int32)
    causal = ca.Causal()

    def varlen_fwd():
        with torch.no_grad():
            return attention_varlen(q, k, v, offsets, offsets, longest, longest, mask=causal,
                                    backend="cudnn")

    def fa_fwd_bwd():
        out = flash_attn_varlen_func(q, k, v, offsets, offsets, longest, longest, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    batch = [torch.randn(len(LENGTHS), HEADS, longest, DIM, device=device, dtype=dtype,
                         generator=g).requires_grad_(True) for _ in range(3)]
    batch_dout = torch.randn(len(LENGTHS), HEADS, longest, DIM, device=device, dtype=dtype,
                             generator=g)
    lengths = torch.tensor(LENGTHS, device=device)
    positions = torch.arange(longest, device=device)
    below = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()

    def torch_padded(backend, backward):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        def call():
            allowed = padded_mask(positions, lengths, below)
            with sdpa_kernel(backend), torch.set_grad_enabled(backward):
                out = sdpa(*batch, attn_mask=allowed)
                return torch.autograd.grad(out, batch, batch_dout) if backward else out
        return call

    from torch.nn.attention import SDPBackend

    found = {"tiny varlen fwd: ours": varlen_fwd,
             "tiny varlen fwd+bwd: flash_attn_varlen_func": fa_fwd_bwd}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        found[f"tiny varlen fwd: torch-{name}"] = torch_padded(backend, False)
        found[f"tiny varlen fwd+bwd: torch-{name}"] = torch_padded(backend, True)
    return found


def rows(us: dict) -> list[dict]:
    """The rows of ``{label: us per call}``: ``vs_torch_cudnn`` = ours over torch's padded call
    of the same direction (cuDNN's, else efficient's)."""
    out = []
    for label, t in us.items():
        direction = label.split(":")[0]
        torch_us = us.get(f"{direction}: torch-cudnn") or us.get(f"{direction}: torch-efficient")
        out.append({"call": label, "us_per_call": t, "vs_bare": None,
                    "vs_torch_cudnn": t / torch_us if torch_us else None})
    return out
