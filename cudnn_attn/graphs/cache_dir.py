"""The graph cache's directory and files, under the trust model of ``trusted_files``.

A graph file reaches cuDNN's native deserializer, so only files this user wrote are used: the
directory must be this user's and not writable by others (``UnsafeCacheDir`` otherwise), files
are regular, this user's, under ``MAX_FILE_BYTES``, never reached through a link, and carry an
HMAC keyed with the per-user secret (``secret_key_path()``). The rules and their code live in
``cudnn_attn.trusted_files`` (the cubin cache follows the same ones); this module names the graph
cache's files.
"""

from __future__ import annotations

import os

from ..trusted_files import (
    KEY_BYTES,
    UnsafeCacheDir,
    clear_files,
    open_dir,
    open_regular_file,
    secret_key,
    secret_key_path,
    write_atomic,
)
from .cache_files import SUFFIX

__all__ = ["KEY_BYTES", "MAX_FILE_BYTES", "UnsafeCacheDir", "clear_dir", "graph_files",
           "open_dir", "open_graph_file", "secret_key", "secret_key_path", "write_graph_file"]

MAX_FILE_BYTES = 256 << 20  # serialized SDPA plans are kilobytes to a few megabytes

open_graph_file = open_regular_file
write_graph_file = write_atomic


def graph_files(dir_fd: int) -> list[os.DirEntry]:
    """Entries named ``*.cagraph`` (whatever they are), sorted by name."""
    with os.scandir(dir_fd) as entries:
        return sorted((e for e in entries if e.name.endswith(SUFFIX)), key=lambda e: e.name)


def clear_dir(directory) -> int:
    """Delete the graph files (``*.cagraph``, and stale temporary files) in ``directory``.

    Returns how many graph files were removed. Links are removed, never followed; directories
    are left alone. A missing directory removes nothing.
    """
    return clear_files(directory, SUFFIX)
