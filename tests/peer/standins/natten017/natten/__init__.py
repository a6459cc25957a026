"""Stand-in for NATTEN 0.17: cudnn_attn.natten, plus NATTEN's kernel switches and capability probes.

No CUDA kernels of NATTEN's exist here: the probes say what this machine has, the switches (which
of NATTEN's kernels to run) do nothing. The autotuner flags are cudnn_attn.natten's own.
"""
import torch

from cudnn_attn.natten import *  # noqa: F401,F403
from cudnn_attn.natten import functional  # noqa: F401


def has_cuda():
    return torch.cuda.is_available()


def has_half(device_index=None):
    return torch.cuda.is_available()


def has_bfloat(device_index=None):
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _no_natten_kernel(*args, **kwargs):
    return False


def _kernel_switch(*args, **kwargs):
    return None


has_gemm = has_fp32_gemm = has_fp64_gemm = has_tf32_gemm = has_fna = _no_natten_kernel
use_tiled_na = use_gemm_na = use_tf32_in_gemm_na = _kernel_switch
enable_gemm_na = disable_gemm_na = enable_tf32 = disable_tf32 = _kernel_switch
enable_tiled_na = disable_tiled_na = _kernel_switch
