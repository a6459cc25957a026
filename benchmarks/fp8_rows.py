"""FP8 rows of benchmarks/cudnn.py: cuDNN's ``sdpa_fp8`` forward and ``sdpa_fp8_backward``
through ``cudnn_attn.sdpa_fp8`` / ``sdpa_fp8_backward`` (``backend="cudnn"``), E4M3 in and out,
D = 128 (the Hopper FP8 backward's only head dim), the throughput problems of cudnn.py (16k
tokens, hidden 2048). A shape cuDNN declines is a row with ``ours_error`` (its reasons), not a
failure. FLOPs as cudnn.py counts them (backward = 2.5 x forward)."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
SCALES_FWD = (1.0, 1.0, 1.0, 1 / 448, 448.0, 1.0)
SCALES_BWD = (1.0, 1.0, 1.0, 1.0, 1.0, 1 / 448, 1 / 64, 448.0, 1.0, 1.0, 1.0, 64.0)


def bench(seqs, args, timed, flops, tokens: int, hidden: int, d: int = 128) -> list[dict]:
    import cudnn_attn as ca
    from cudnn_attn.errors import NotSupportedError

    rows = []
    h = hidden // d
    for s in seqs:
        b = max(1, tokens // s)
        for causal in (False, True):
            q, k, v = ((torch.randn(b, h, s, d, device="cuda") * 0.5).to(E4M3) for _ in range(3))
            fa = ca.SdpaAttributes().set_attn_scale(d ** -0.5).set_causal_mask(causal)
            ba = ca.SdpaBackwardAttributes().set_attn_scale(d ** -0.5).set_causal_mask(causal)
            base = {"dtype": "float8_e4m3fn", "D": d, "S": s, "B": b, "H": h, "causal": causal}
            fns = {"fwd": lambda: ca.sdpa_fp8(q, k, v, *SCALES_FWD, fa, backend="cudnn")}
            try:
                o, stats, *_ = fns["fwd"]()
                d_o = (torch.randn_like(o, dtype=torch.float32) * 0.5).to(E4M3)
                fns["bwd"] = lambda: ca.sdpa_fp8_backward(q, k, v, o, d_o, stats, *SCALES_BWD,
                                                          ba, backend="cudnn")
            except NotSupportedError as exc:
                fns = {"fwd": str(exc), "bwd": str(exc)}
            for direction in ("fwd", "bwd"):
                row = dict(base, dir=direction)
                fn = fns.get(direction)
                try:
                    if isinstance(fn, str):
                        raise NotSupportedError(fn, {})
                    row["ours_ms"] = timed(fn, args)
                    row["ours_tflops"] = flops(b, h, s, d, causal, direction) / row["ours_ms"] / 1e9
                except NotSupportedError as exc:
                    row["ours_tflops"] = None
                    row["ours_error"] = str(exc).splitlines()[-1][:200]
                rows.append(row)
    return rows
