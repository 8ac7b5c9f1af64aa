"""``python -m comfy_env`` runs the CLI."""

import sys

from ._cli import main

sys.exit(main())
