"""NATTEN's APIs: ``functional`` (na1d/2d/3d, merge_attentions), ``unfused`` (NATTEN 0.17's
na*d_qk/av), ``modules`` (NeighborhoodAttention1D/2D/3D), ``ops`` (libnatten's out-parameter ops) and
``common`` (geometry, the rpb check, the fused call through dispatch). Import order has no cycle:
common <- unfused <- functional <- modules; ops uses common. ``cudnn_attn.neighborhood`` assembles
functional + modules into the public namespace."""
