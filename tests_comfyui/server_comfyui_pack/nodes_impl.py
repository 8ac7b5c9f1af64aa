"""Node code that needs the server's ComfyUI: real ``nodes``, ``node_helpers``, ``server``,
``comfy.cli_args`` and ``comfy.model_management`` (runs only in the worker)."""

import json
import os
import sys

import comfy.model_management as mm
import comfy.utils
import folder_paths
import node_helpers  # noqa: F401 - a module the stand-ins do not offer
import nodes
import torch
from comfy.cli_args import args
from server import PromptServer


class Report:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "comfy-env tests"

    def run(self, image):
        bar = comfy.utils.ProgressBar(3)
        for _ in range(3):
            bar.update(1)
        PromptServer.instance.send_sync("ce_server_probe", {"pid": os.getpid()})
        info = {
            "pid": os.getpid(),
            "prefix": sys.prefix,
            "device": str(mm.get_torch_device()),
            "cpu_state": str(mm.cpu_state),
            "args_cpu": bool(args.cpu),
            "output": folder_paths.get_output_directory(),
            "temp": folder_paths.get_temp_directory(),
            "input": folder_paths.get_input_directory(),
            "checkpoints": folder_paths.get_folder_paths("checkpoints"),
            "nodes": os.path.dirname(os.path.abspath(nodes.__file__)),
            "torch": torch.__file__,
            "max_resolution": nodes.MAX_RESOLUTION,
            "shape": list(image.shape),
        }
        return {"ui": {"report": [json.dumps(info)]}, "result": (json.dumps(info),)}


class Steps:
    """Loops, checking ComfyUI's interrupt the way ComfyUI's samplers do (through the module
    attribute, and a ProgressBar), until interrupted."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"steps": ("INT", {"default": 2000, "max": 100000})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "comfy-env tests"

    def run(self, steps):
        import time

        bar = comfy.utils.ProgressBar(steps)
        for _ in range(steps):
            comfy.model_management.throw_exception_if_processing_interrupted()
            bar.update(1)
            time.sleep(0.05)
        return (os.getpid(),)


class Save(nodes.SaveImage):
    """ComfyUI's own SaveImage, subclassed: saves into the server's output directory."""

    CATEGORY = "comfy-env tests"


NODE_CLASS_MAPPINGS = {"CE_ServerReport": Report, "CE_ServerSave": Save, "CE_ServerSteps": Steps}
