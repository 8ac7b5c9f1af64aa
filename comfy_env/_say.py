"""The package logger, with ``logging`` imported on first use.

``comfy-env status`` and ``sweep`` start an interpreter for one short job; ``logging`` alone
is about a sixth of that start-up. The modules on their path (``_rundir``, ``_status``,
``_sweep``) say what they have to say through ``package_logger()``, so a run with nothing to
say never imports it. (``_settings``, a leaf that imports nothing of the package, imports
``logging`` in place.)
"""

from __future__ import annotations

# (Not ``typing.TYPE_CHECKING``: typing is one of the imports those commands avoid.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging


def package_logger() -> logging.Logger:
    """``logging.getLogger("comfy_env")``, importing ``logging`` only now."""
    import logging

    return logging.getLogger("comfy_env")
