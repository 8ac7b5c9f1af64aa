"""Example pack whose env does not exist: ComfyUI lists it as IMPORT FAILED with comfy-env's
message, and the server starts anyway. Its nodes are never imported into the server."""

from comfy_env.comfyui import isolate

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
    __file__, env="no-such-env", module="nodes_impl"
)
