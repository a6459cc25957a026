"""Packed (varlen) and paged (KV-cache) calls: their arguments, their problems over cuDNN's
storage, and the torch engine's grouping by length."""
