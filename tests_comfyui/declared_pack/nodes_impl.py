import os
import sys

import numpy as np


class DeclaredNumpy:
    """Reports the numpy its env has, the env's prefix and its worker's pid; inverts an IMAGE
    (the server's torch tensor arrives as this env's numpy 1 array)."""

    CATEGORY = "comfy-env/tests"
    RETURN_TYPES = ("STRING", "INT", "IMAGE")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def run(self, image):
        return (f"{np.__version__} {sys.prefix}", os.getpid(), np.float32(1.0) - image)


NODE_CLASS_MAPPINGS = {"CE_DeclaredNumpy": DeclaredNumpy}
