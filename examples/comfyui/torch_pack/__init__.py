"""Example node pack: its nodes run in a venv with its own (CPU) torch.

The env is ``.venv`` in this directory (``python -m venv .venv && .venv/bin/pip install torch``);
the integration tests point it elsewhere with ``COMFY_ENV_EXAMPLE_TORCH_ENV``.
"""

import os

from comfy_env.comfyui import isolate

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
    __file__,
    env=os.environ.get("COMFY_ENV_EXAMPLE_TORCH_ENV", ".venv"),
    module="nodes_impl",
    # Importing torch takes seconds: the worker is started and the module imported in the
    # background when ComfyUI loads the pack, and again right after a crash.
    warm=True,
)
