"""Worker side of ``comfy_env.comfyui``: ComfyUI node packs running in their own env.

Stdlib only, Python 3.8 parseable, never imports ``comfy_env`` or ComfyUI. Modules:

- ``standins``: small stand-ins for the parts of ComfyUI that node code imports
  (``comfy.utils.ProgressBar``, ``comfy.model_management``'s interrupt helpers,
  ``server.PromptServer``, ``folder_paths``, ``comfy_api.latest``), installed into
  ``sys.modules`` only where the env lacks the real module. They forward to the host through the
  call's event channel (when the host's pool offers one) and read the host's directories from the
  context each node call carries.
- ``values``: how node inputs and outputs cross: tensors flattened into one list so every one
  travels out of band through shared memory, torch or numpy as the env allows.
- ``scan``: imports a pack's node module here (never in the server) and extracts the node
  metadata ComfyUI reads (V1 attributes, V3 schema) into plain data.
- ``runner``: the functions the host's node proxies call: run a node (one instance per node id
  and proxy), ``IS_CHANGED``, ``VALIDATE_INPUTS``, ``check_lazy_status``.
"""
