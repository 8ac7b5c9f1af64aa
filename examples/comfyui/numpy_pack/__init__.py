"""Example node pack: its nodes run in a venv with numpy only (no torch, no ComfyUI).

The env is the one ``pyproject.toml`` beside this file declares (``[project] dependencies``,
``[tool.comfy.isolation]``): comfy-env builds it with uv at the first start and reuses it after.
The integration tests point it at a prepared venv instead with ``COMFY_ENV_EXAMPLE_NUMPY_ENV``.
"""

import os

from comfy_env.comfyui import isolate

# Front-end files: ComfyUI reads WEB_DIRECTORY from this module, which runs in the server.
WEB_DIRECTORY = "./web"

_prepared = os.environ.get("COMFY_ENV_EXAMPLE_NUMPY_ENV")
if _prepared:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
        __file__, env=_prepared, module="nodes_impl"
    )
else:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(__file__, module="nodes_impl")
