"""A test-only pack whose node code imports ComfyUI's own modules (``nodes``, ``node_helpers``,
``comfy.cli_args``, ``server``), isolated with ``comfyui="server"``: once in the server's own
interpreter (``env=None``) and, when ``CE_TEST_LAYERED_ENV`` names one, in an empty venv
of the server's Python layered on the server's packages (nodes renamed ``CE_Layered*``)."""

import os

from comfy_env.comfyui import isolate

NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(
    __file__, env=None, module="nodes_impl", comfyui="server"
)
_layered = os.environ.get("CE_TEST_LAYERED_ENV")
if _layered:
    _mappings, _ = isolate(__file__, env=_layered, module="nodes_impl", comfyui="server")
    NODE_CLASS_MAPPINGS = dict(NODE_CLASS_MAPPINGS)
    NODE_CLASS_MAPPINGS.update(
        {name.replace("CE_Server", "CE_Layered"): cls for name, cls in _mappings.items()}
    )
