"""GPU check of the cuDNN score_mod graphs (issue 29; never run yet): softcap (plain, causal,
window), NATTEN 1-D/2-D/dilated neighborhoods, the causal 1-D band and a builder score_mod run on
cuDNN, forward and backward, against the float64 torch engine. Prints one JSON object.

    python benchmarks/score_mod_gpu_check.py
"""
import json
import sys
import time
import traceback

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend

import torch  # noqa: E402

import cudnn_attn as ca  # noqa: E402
from cudnn_attn.masks import Causal, Neighborhood, SlidingWindow  # noqa: E402

print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
try:
    import cudnn
    print("cudnn", cudnn.backend_version(), flush=True)
except Exception as exc:
    print("no cudnn frontend:", exc)
    sys.exit(0)

results = {}


def check(name, fn):
    t = time.time()
    try:
        results[name] = fn()
    except Exception as exc:
        results[name] = f"ERROR {type(exc).__name__}: {str(exc)[:400]}"
        traceback.print_exc(limit=2)
    print(name, results[name], f"{time.time() - t:.1f}s", flush=True)


def attention_case(n, d, kw, heads=4, batch=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", generator=g, dtype=torch.float16)
               .requires_grad_() for _ in range(3))
    out = ca.attention(q, k, v, backend="cudnn", **kw)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ca.attention(*ref_in, backend="torch", **kw)
    d_o = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), d_o)
    want = torch.autograd.grad(ref, ref_in, d_o.double())
    errs = [(out.double() - ref).abs().max().item()] + [
        (a.double() - b).abs().max().item() for a, b in zip(got, want)]
    return {"max_abs_err_out_dq_dk_dv": [round(e, 5) for e in errs],
            "ok": errs[0] < 2e-2 and max(errs[1:]) < 5e-2}


check("softcap-causal", lambda: attention_case(256, 64, dict(softcap=30.0, mask=Causal())))
check("softcap-window", lambda: attention_case(512, 128, dict(softcap=20.0,
                                                            mask=SlidingWindow(127, 0))))
check("softcap-plain", lambda: attention_case(200, 64, dict(softcap=5.0)))
check("natten-1d", lambda: attention_case(256, 64, dict(mask=Neighborhood((256,), (63,)))))
check("natten-2d", lambda: attention_case(1024, 64, dict(mask=Neighborhood((32, 32), (13, 13)))))
check("natten-2d-dilated", lambda: attention_case(
    576, 64, dict(mask=Neighborhood((24, 24), (5, 5), dilation=2))))
check("natten-1d-causal-band", lambda: attention_case(
    256, 64, dict(mask=Neighborhood((256,), (31,), is_causal=True))))


def builder_case():
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", generator=g, dtype=torch.float16)
               for _ in range(3))

    def mod(gr, s):
        row, col = gr.gen_index(input=s, axis=2), gr.gen_index(input=s, axis=3)
        return gr.binary_select(input0=s, input1=float("-inf"),
                                mask=gr.cmp_ge(input=row, comparison=col))
    o, st = ca.scaled_dot_product_flash_attention(q, k, v, ca.SdpaAttributes()
                                                  .set_attn_scale(0.125).set_score_mod(mod))
    ref, ref_st = ca.scaled_dot_product_flash_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(),
        ca.SdpaAttributes().set_attn_scale(0.125).set_causal_mask(True))
    return {"err_o": round((o.double().cpu() - ref).abs().max().item(), 5),
            "err_stats": round((st.double().cpu() - ref_st).abs().max().item(), 5)}


check("builder-score-mod-causal", builder_case)
print(json.dumps(results, indent=1))
