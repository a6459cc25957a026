import torch


def is_fp8(dtype):
    return dtype in (torch.float8_e5m2, torch.float8_e4m3fn)
