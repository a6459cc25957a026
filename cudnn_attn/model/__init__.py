"""The problem model: masks and biases, ``AttnProblem``, the argument validators, the visibility
rules (``geometry``), packed/paged storage, runtime inputs and dropout state, score_mod programs."""
