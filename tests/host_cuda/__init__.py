"""Host (CPU) emulation of the package's CUDA kernels for the CPU test suite: ``emu.h`` + ``build.py``."""
