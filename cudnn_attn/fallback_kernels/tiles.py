"""Old name of :mod:`.tile_shapes` (kept for ``compat/natten``); new code imports ``tile_shapes``."""

from .limits import FUSED_DTYPES, MAX_HEAD_DIM  # noqa: F401
from .tile_shapes import FUSED_KEY_TILE as KEY_TILE  # noqa: F401
from .tile_shapes import FUSED_QUERY_TILE as QUERY_TILE  # noqa: F401
from .tile_shapes import check_tile_sizes, valid_tile_sizes  # noqa: F401
