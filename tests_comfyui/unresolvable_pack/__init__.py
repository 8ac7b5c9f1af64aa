"""Test pack: its declared env cannot be resolved (no such package); ComfyUI must list it as
IMPORT FAILED with the resolver's message while every other pack works."""

from comfy_env.comfyui import isolate

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(__file__, module="nodes_impl")
