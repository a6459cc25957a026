"""NATTEN 0.21's ``generate_varlen_parameters``: lengths -> cumulative offsets and maxima."""
from cudnn_attn.compat.natten.varlen_args import offsets


def generate_varlen_parameters(query, key, value, seqlens_Q=None, seqlens_KV=None):
    found = offsets(query, key, seqlens_Q, seqlens_KV, None, None, None, None)
    return (None, None, 0, 0) if found is None else found
