"""Example node pack: its nodes run in an env with its own torch.

The env is the one ``pyproject.toml`` beside this file declares: comfy-env builds it with uv at
the first start and reuses it after. The integration tests point it at a prepared venv (a CPU
torch) instead with ``COMFY_ENV_EXAMPLE_TORCH_ENV``.
"""

import os

from comfy_env.comfyui import isolate

# Importing torch takes seconds: with warm=True the worker is started and the module imported
# in the background when ComfyUI loads the pack, and again right after a crash.
_prepared = os.environ.get("COMFY_ENV_EXAMPLE_TORCH_ENV")
if _prepared:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
        __file__, env=_prepared, module="nodes_impl", warm=True
    )
else:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
        __file__, module="nodes_impl", warm=True
    )
