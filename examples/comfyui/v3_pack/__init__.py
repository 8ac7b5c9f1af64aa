"""Example V3 node pack (``comfy_entrypoint`` and ``io.ComfyNode``) in a numpy-only env.

The env is the one ``pyproject.toml`` beside this file declares: comfy-env builds it with uv at
the first start and reuses it after. The integration tests point it at a prepared venv instead
with ``COMFY_ENV_EXAMPLE_NUMPY_ENV``.
"""

import os

from comfy_env.comfyui import isolate

_prepared = os.environ.get("COMFY_ENV_EXAMPLE_NUMPY_ENV")
if _prepared:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
        __file__, env=_prepared, module="v3_nodes"
    )
else:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(__file__, module="v3_nodes")
