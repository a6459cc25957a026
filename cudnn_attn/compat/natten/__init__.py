"""NATTEN's APIs: ``functional`` (na1d/2d/3d, unfused qk/av, merge_attentions), ``modules`` and ``ops``."""
