"""``python -m cudnn_attn`` runs the ``cudnn-attn`` command line."""

import sys

from cudnn_attn.cli import main

sys.exit(main())
