"""A test-only shim: cubiq's ComfyUI_essentials, unchanged (its directory named by
``CE_TEST_ESSENTIALS``), isolated with the server's ComfyUI in its worker. Its nodes are
registered under their own names plus `` (isolated)``, beside the same pack loaded in-process,
so one prompt runs both; ``CE_TensorHash`` (in-process) digests what they return."""

import hashlib
import os

from comfy_env.comfyui import isolate

SUFFIX = " (isolated)"
_mappings, _display = isolate(
    os.environ["CE_TEST_ESSENTIALS"], env=None, module="__init__", comfyui="server"
)


def _digest(value):
    if value is None:
        return None
    if hasattr(value, "numpy"):
        data = value.detach().cpu().contiguous().numpy().tobytes()
        return f"{tuple(value.shape)} {value.dtype} {hashlib.sha256(data).hexdigest()}"
    return repr(value)


class TensorHash:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {},
            "optional": {
                "image": ("IMAGE",),
                "mask": ("MASK",),
                "a": ("INT", {"forceInput": True}),
                "b": ("INT", {"forceInput": True}),
                "c": ("INT", {"forceInput": True}),
            },
        }

    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "comfy-env tests"

    def run(self, image=None, mask=None, a=None, b=None, c=None):
        parts = [_digest(v) for v in (image, mask, a, b, c)]
        return {"ui": {"digest": [" | ".join(str(p) for p in parts)]}}


NODE_CLASS_MAPPINGS = {name + SUFFIX: cls for name, cls in _mappings.items()}
NODE_CLASS_MAPPINGS["CE_TensorHash"] = TensorHash
NODE_DISPLAY_NAME_MAPPINGS = {name + SUFFIX: f"{text}{SUFFIX}" for name, text in _display.items()}
