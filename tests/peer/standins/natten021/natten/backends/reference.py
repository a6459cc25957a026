def reference_fna_generic(*args, **kwargs):
    raise NotImplementedError("NATTEN's compiled reference kernels are not part of this run")
