"""The (q_tile, kv_tile) sizes NATTEN 0.21's CUTLASS FMHA lists on an SM80/SM90 GPU, which its tests
pass back to ``attention`` one by one. On the CPU NATTEN lists none; here they are the values the
tests exercise: cudnn_attn validates them and takes them as hints (its engines pick their tiles)."""


def get_all_fmha_forward_configs(input_tensor):
    return [(32, 128), (64, 64), (64, 128)]


def get_all_fmha_backward_configs(input_tensor):
    if input_tensor.dtype.itemsize == 4:
        return [(64, 64), (128, 64)]
    return [(64, 64), (128, 128)]
