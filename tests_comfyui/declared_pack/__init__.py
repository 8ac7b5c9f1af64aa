"""Test pack: its env is declared in pyproject.toml (numpy 1.26.4 while the server has numpy
2.x) and built by comfy-env at the server's start; nothing else is needed."""

from comfy_env.comfyui import isolate

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(__file__, module="nodes_impl")
