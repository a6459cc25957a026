"""NATTEN 0.17's argument normalisation helpers, as its tests import them."""
import math


def _per_axis(value, na_dim, cast):
    if isinstance(value, (tuple, list)):
        return tuple(cast(v) for v in value)
    return (cast(value),) * na_dim


def check_all_args(na_dim, kernel_size, dilation, is_causal):
    causal = False if is_causal is None else is_causal
    return (_per_axis(kernel_size, na_dim, int), _per_axis(dilation, na_dim, int),
            _per_axis(causal, na_dim, bool))


def get_num_na_weights(kernel_size):
    return math.prod(kernel_size)
