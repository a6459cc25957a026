"""The machinery between a surface and an engine: the engine registry and selection
(``dispatch``), the one run API (``execution``), the unfused NATTEN ops' dispatch, FP8 engine
choice, caches, trusted cache files, environment and optional-module probes."""
