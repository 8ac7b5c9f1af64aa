"""Example node pack: its nodes run in a venv with numpy only (no torch, no ComfyUI).

The env is ``.venv`` in this directory (``python -m venv .venv && .venv/bin/pip install numpy``);
the integration tests point it elsewhere with ``COMFY_ENV_EXAMPLE_NUMPY_ENV``.
"""

import os

from comfy_env.comfyui import isolate

# Front-end files: ComfyUI reads WEB_DIRECTORY from this module, which runs in the server.
WEB_DIRECTORY = "./web"

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
    __file__,
    env=os.environ.get("COMFY_ENV_EXAMPLE_NUMPY_ENV", ".venv"),
    module="nodes_impl",
)
