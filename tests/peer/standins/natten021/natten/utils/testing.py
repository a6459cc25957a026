"""NATTEN 0.21's skip decorators: the files run here are gated on NATTEN's compiled library, whose
place cudnn_attn takes, so they run; extended sweeps and Hopper/Blackwell kernels skip."""


def _skip(reason):
    def decorator(f):
        def wrapper(self, *args, **kwargs):
            self.skipTest(reason)
        return wrapper
    return decorator


def skip_if_libnatten_is_not_supported():
    return lambda f: f


def skip_if_not_running_extended_tests():
    return _skip("NATTEN_RUN_EXTENDED_TESTS is off")


def skip_if_hopper_kernels_not_supported():
    return _skip("NATTEN's Hopper kernels")


def skip_if_blackwell_kernels_not_supported():
    return _skip("NATTEN's Blackwell kernels")


def supports_float16(device):  # NATTEN 0.21: True on any non-CUDA device
    return True


def supports_bfloat16(device):  # NATTEN 0.21: False on any non-CUDA device
    return False
