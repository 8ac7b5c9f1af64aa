"""Nodes of the torch example pack, imported only in its env (its own CPU torch)."""

import time

import torch


class TorchInvert:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("IMAGE", "STRING")
    FUNCTION = "invert"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def invert(self, image):
        with torch.inference_mode():
            out = 1.0 - image
        return (out, "%s %s" % (type(image).__module__, torch.__version__))


class TorchLatent:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("LATENT", "MASK")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",), "mask": ("MASK",)}}

    def run(self, latent, mask):
        return ({"samples": latent["samples"] * 3.0}, 1.0 - mask)


class TorchSleepStamp:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"seconds": ("FLOAT", {"default": 1.0}), "tag": ("STRING", {"default": ""})}
        }

    def run(self, seconds, tag):
        start = time.time()
        time.sleep(seconds)
        return ("%f %f" % (start, time.time()),)


class TorchPassthrough:
    """Returns its IMAGE unchanged (the benchmark's node)."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def run(self, image):
        return (image,)


NODE_CLASS_MAPPINGS = {
    "CE_TorchPassthrough": TorchPassthrough,
    "CE_TorchInvert": TorchInvert,
    "CE_TorchLatent": TorchLatent,
    "CE_TorchSleepStamp": TorchSleepStamp,
}
