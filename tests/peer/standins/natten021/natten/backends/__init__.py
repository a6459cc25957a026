"""NATTEN's backend queries, answered with NATTEN's names, which cudnn_attn accepts as hints."""


def get_compatible_backends(*args, **kwargs):
    return ["cutlass-fna"]


def get_compatible_fmha_backends(*args, **kwargs):
    return ["cutlass-fmha"]
