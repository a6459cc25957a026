"""The torch engine: exact attention on any device and dtype, tile by tile; the oracle of the others.

``backend`` (the engine and its plans), ``tiles`` (tile tables from the visibility rules),
``layouts`` (call layout <-> the internal row layout), ``cpu_sdpa`` (PyTorch's SDPA CPU kernel
where it gives the same result).
"""
