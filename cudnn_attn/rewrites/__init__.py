"""Exact rewrites every engine runs: merging partial results through their lse, attention sinks,
keys and values with different head counts."""
