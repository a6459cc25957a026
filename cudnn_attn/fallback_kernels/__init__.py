"""CuPy RawKernels for the masks cuDNN cannot express (neighborhood attention first)."""
