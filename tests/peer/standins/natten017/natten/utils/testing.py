"""NATTEN 0.17's skip decorators: CUDA-only tests skip without CUDA; the GEMM ones test NATTEN's
own CUDA GEMM kernels and always skip; nested tensors are supported."""
import torch


def _skip_unless(ok, reason):
    def decorator(f):
        def wrapper(self, *args, **kwargs):
            if not ok():
                self.skipTest(reason)
            return f(self, *args, **kwargs)
        return wrapper
    return decorator


def skip_if_cuda_is_not_supported():
    return _skip_unless(torch.cuda.is_available, "CUDA is not available.")


def skip_if_gemm_does_not_support_double_precision():
    return _skip_unless(lambda: False, "tests NATTEN's own CUDA GEMM kernels")


def skip_if_gemm_is_not_supported():
    return _skip_unless(lambda: False, "tests NATTEN's own CUDA GEMM kernels")


def skip_if_nested_is_not_supported():
    return _skip_unless(lambda: True, "")
