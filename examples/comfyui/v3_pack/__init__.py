"""Example V3 node pack (``comfy_entrypoint`` and ``io.ComfyNode``) in a numpy-only venv."""

import os

from comfy_env.comfyui import isolate

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
    __file__,
    env=os.environ.get("COMFY_ENV_EXAMPLE_NUMPY_ENV", ".venv"),
    module="v3_nodes",
)
