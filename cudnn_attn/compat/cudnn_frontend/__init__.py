"""The cuDNN frontend's SDPA attribute builder (``attributes``)."""
