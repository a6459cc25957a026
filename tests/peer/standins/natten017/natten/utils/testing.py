"""NATTEN 0.17's skip decorators. CUDA-only tests skip without CUDA; the GEMM ones test NATTEN's own
CUDA GEMM kernels and always skip; the FlexAttention ones (Triton) always skip. Fused neighborhood
attention, nested tensors, additional KV and torch.compile are cudnn_attn's, so those tests run."""
import torch


def _skip_unless(ok, reason):
    def decorator(f):
        def wrapper(self, *args, **kwargs):
            if not ok():
                self.skipTest(reason)
            return f(self, *args, **kwargs)
        return wrapper
    return decorator


def _runs(f):
    return f


def skip_if_cuda_is_not_supported():
    return _skip_unless(torch.cuda.is_available, "CUDA is not available.")


def skip_if_gemm_does_not_support_double_precision():
    return _skip_unless(lambda: False, "tests NATTEN's own CUDA GEMM kernels")


def skip_if_gemm_is_not_supported():
    return _skip_unless(lambda: False, "tests NATTEN's own CUDA GEMM kernels")


def skip_if_triton_is_not_supported():
    return _skip_unless(lambda: False, "NATTEN's FlexAttention backend (natten.flex)")


def skip_if_nested_is_not_supported():
    return _runs


def skip_if_fna_is_not_supported():
    return _runs


def skip_if_torch_compile_is_not_supported():
    return _runs


def skip_if_experimental_ops_are_not_supported():
    return _runs


def fna_supports_additional_kv(head_dim):
    return True
