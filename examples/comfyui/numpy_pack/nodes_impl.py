"""Nodes of the numpy example pack. Imported only in the pack's env (numpy, no torch, no
ComfyUI): ``folder_paths``, ``comfy.utils`` and ``comfy.model_management`` are comfy-env's
stand-ins there. Tensors arrive as numpy arrays ([B,H,W,C] float32 IMAGE, [B,H,W] MASK,
{"samples": [B,C,H,W]} LATENT)."""

import ctypes
import os
import signal
import struct
import time
import zlib

import comfy.model_management
import folder_paths
import numpy as np
from aiohttp import web  # this env has no aiohttp: comfy-env's stand-in serves routes
from comfy.utils import ProgressBar
from server import PromptServer

# Read when the module is imported, as many packs do: the server's directories, in the env too.
INPUT_DIR = folder_paths.get_input_directory()
OUTPUT_DIR = folder_paths.get_output_directory()


class InvertImage:
    CATEGORY = "comfy-env/examples"
    DESCRIPTION = "1 - image, in the pack's own env"
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("image", "kind")
    FUNCTION = "invert"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def invert(self, image):
        return (np.float32(1.0) - image, type(image).__module__)


class Passthrough:
    """Returns its IMAGE unchanged (the benchmark's node)."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def run(self, image):
        return (image,)


class MaskAndLatent:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("MASK", "LATENT")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mask": ("MASK",),
                "latent": ("LATENT",),
                "add": ("FLOAT", {"default": 1.0, "min": -10, "max": 10}),
            }
        }

    def run(self, mask, latent, add):
        out = dict(latent)
        out["samples"] = latent["samples"] + np.float32(add)
        return (mask * np.float32(2.0), out)


class Segfault:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    def run(self, value):
        print("about to touch address 0", flush=True)
        ctypes.string_at(0)
        return (value,)


class MeshError(ValueError):
    """A pack's own exception type (the host cannot import it: it arrives as RemoteError)."""


class Raise:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    def run(self, value):
        if value == 1:
            raise MeshError("degenerate mesh: %d faces" % value)
        raise ValueError("bad value %d" % value)


class SlowSteps:
    """Reports progress each step and checks ComfyUI's interrupt (cooperative); announces
    itself with ``PromptServer.instance.send_sync`` first."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "steps": ("INT", {"default": 5, "min": 1, "max": 10000}),
                "delay": ("FLOAT", {"default": 0.05, "min": 0, "max": 10}),
            }
        }

    def run(self, steps, delay):
        PromptServer.instance.send_sync("comfy_env.example", {"steps": steps, "pid": os.getpid()})
        bar = ProgressBar(steps)
        for _ in range(steps):
            comfy.model_management.throw_exception_if_processing_interrupted()
            time.sleep(delay)
            bar.update(1)
        return (os.getpid(),)


class StuckNative:
    """Blocks in native code (libc sleep) where no Python check can run."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seconds": ("INT", {"default": 60})}}

    def run(self, seconds):
        ctypes.CDLL(None).sleep(seconds)
        return (seconds,)


class Kernel:
    """A heavy object that never leaves the worker."""

    def __init__(self, scale):
        self.scale = np.float32(scale)
        self.pid = os.getpid()
        self.uses = 0

    def apply(self, image):
        self.uses += 1
        return image * self.scale


class LoadKernel:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("CE_KERNEL", "INT")
    RETURN_NAMES = ("kernel", "pid")
    FUNCTION = "load"
    LOADS = [0]

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"scale": ("FLOAT", {"default": 2.0})}}

    def load(self, scale):
        LoadKernel.LOADS[0] += 1
        return (Kernel(scale), os.getpid())


class UseKernel:
    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("IMAGE", "STRING")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"kernel": ("CE_KERNEL",), "image": ("IMAGE",)},
            "optional": {"crash": ("BOOLEAN", {"default": False})},
        }

    def run(self, kernel, image, crash=False):
        if crash:
            ctypes.string_at(0)
        out = kernel.apply(image)
        return (out, "pid=%d uses=%d loads=%d" % (kernel.pid, kernel.uses, LoadKernel.LOADS[0]))


class BigModel:
    """A large object that stays in the worker: a stand-in for model weights (its pages are
    written, so they count in the worker's RSS). ``crash_on_release`` kills the worker when
    the object is freed (to crash a worker in the middle of an eviction)."""

    def __init__(self, megabytes, crash_on_release):
        self.weights = np.ones(int(megabytes) * 1024 * 1024 // 8, dtype=np.float64)
        self.crash_on_release = bool(crash_on_release)
        self.pid = os.getpid()
        self.extra = []  # what UseBigModel(grow=...) adds later

    def __del__(self):
        if self.crash_on_release:
            os.kill(os.getpid(), signal.SIGKILL)


class LoadBigModel:
    """Loads a BigModel; ComfyUI's model manager sees it (size measured in the worker)."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("CE_BIG_MODEL",)
    FUNCTION = "load"
    LOADS = [0]

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"megabytes": ("INT", {"default": 64, "min": 1, "max": 4096})},
            "optional": {
                "crash_on_release": ("BOOLEAN", {"default": False}),
                "tag": ("INT", {"default": 0}),
            },
        }

    def load(self, megabytes, crash_on_release=False, tag=0):
        LoadBigModel.LOADS[0] += 1
        return (BigModel(megabytes, crash_on_release),)


class UseBigModel:
    """An output node that uses up to three BigModels and reports the worker's pid, how often a
    model was loaded in this worker, and the models' sizes."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("CE_BIG_MODEL",)},
            "optional": {
                "model2": ("CE_BIG_MODEL",),
                "model3": ("CE_BIG_MODEL",),
                "grow_megabytes": ("INT", {"default": 0, "min": 0}),
            },
        }

    def run(self, model, model2=None, model3=None, grow_megabytes=0):
        if grow_megabytes:
            model.extra.append(np.ones(grow_megabytes * 1024 * 1024 // 8, dtype=np.float64))
        models = [m for m in (model, model2, model3) if m is not None]
        report = {
            "pid": os.getpid(),
            "loads": LoadBigModel.LOADS[0],
            "megabytes": [m.weights.nbytes // (1024 * 1024) for m in models],
            "sum": float(sum(float(m.weights[:8].sum()) for m in models)),
        }
        return {"ui": {"report": [report]}}


class SleepStamp:
    """Sleeps, then returns "start end" wall-clock stamps (for the overlap test)."""

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


def _png(rgb):
    """A minimal PNG encoder (stdlib zlib), so this env needs no Pillow."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


class SaveImagePNG:
    """An output node: writes PNGs into ComfyUI's output directory (through the
    ``folder_paths`` stand-in) and returns the UI result ComfyUI shows."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "images": ("IMAGE",),
                "filename_prefix": ("STRING", {"default": "comfy_env"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID", "prompt": "PROMPT"},
        }

    def save(self, images, filename_prefix, unique_id=None, prompt=None):
        out_dir = folder_paths.get_output_directory()
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, out_dir, images.shape[2], images.shape[1]
        )
        results = []
        for image in images:
            rgb = (np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8)
            filename = "%s_%05d_.png" % (name, counter)
            with open(os.path.join(folder, filename), "wb") as fh:
                fh.write(_png(rgb))
            results.append({"filename": filename, "subfolder": subfolder, "type": "output"})
            counter += 1
        return {
            "ui": {"images": results, "node": [str(unique_id)], "prompt_nodes": [len(prompt or {})]}
        }


class Lazy:
    """Forwards IS_CHANGED, VALIDATE_INPUTS and a lazy input."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "use_b": ("BOOLEAN", {"default": False}),
                "a": ("INT", {"default": 1, "lazy": True}),
                "b": ("INT", {"default": 2, "lazy": True}),
                "limit": ("INT", {"default": 100}),
            }
        }

    @classmethod
    def VALIDATE_INPUTS(cls, limit):
        if limit > 1000:
            return "limit %d is over 1000 (checked in the env)" % limit
        return True

    @classmethod
    def IS_CHANGED(cls, use_b, a, b, limit):
        return "%s-%s" % (use_b, limit)

    def check_lazy_status(self, use_b, a=None, b=None, limit=None):
        return ["b"] if use_b else ["a"]

    def run(self, use_b, a=None, b=None, limit=None):
        return (b if use_b else a,)


class Digest:
    """An output node that reports what it received (shape, dtype, exact values) as its UI
    result, so tests can check values through ComfyUI's history."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {},
            "optional": {
                "image": ("IMAGE",),
                "mask": ("MASK",),
                "latent": ("LATENT",),
                "text": ("STRING", {"forceInput": True}),
                "text2": ("STRING", {"forceInput": True}),
                "number": ("INT", {"forceInput": True}),
            },
        }

    def run(self, image=None, mask=None, latent=None, text=None, text2=None, number=None):
        report = {}
        for name, value in (
            ("image", image),
            ("mask", mask),
            ("latent", None if latent is None else latent["samples"]),
        ):
            if value is not None:
                report[name] = {
                    "type": type(value).__module__,
                    "dtype": str(value.dtype),
                    "shape": list(value.shape),
                    "values": value.reshape(-1).tolist(),
                }
        for name, value in (("text", text), ("text2", text2), ("number", number)):
            if value is not None:
                report[name] = value
        return {"ui": {"digest": [report]}}


# Routes on the server, answered in this env (the server forwards each request here).
routes = PromptServer.instance.routes


@routes.get("/comfy_env_example/info/{name}")
async def example_info(request):
    return web.json_response(
        {"name": request.match_info["name"], "q": request.query.get("q"), "pid": os.getpid()}
    )


@routes.post("/comfy_env_example/echo")
async def example_echo(request):
    return web.json_response({"echo": await request.json()})


class LoadInputFile:
    """Offers the files of the server's input directory, as ComfyUI's LoadImage does (the list
    follows uploads); returns the chosen file's size."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        folder = folder_paths.get_input_directory()
        names = os.listdir(folder) if os.path.isdir(folder) else []
        files = sorted(n for n in names if os.path.isfile(os.path.join(folder, n)))
        return {"required": {"file": (files,)}}

    def run(self, file):
        return (os.path.getsize(os.path.join(folder_paths.get_input_directory(), file)),)


class Directories:
    """The server's input and output directories as this module saw them at import, and the
    pid of the worker that imported it."""

    CATEGORY = "comfy-env/examples"
    RETURN_TYPES = ("STRING", "INT")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls):
        return float("nan")  # runs every time: it reports which worker ran it

    def run(self):
        return ("%s|%s" % (INPUT_DIR, OUTPUT_DIR), os.getpid())


NODE_CLASS_MAPPINGS = {
    "CE_Digest": Digest,
    "CE_Directories": Directories,
    "CE_LoadInputFile": LoadInputFile,
    "CE_InvertImage": InvertImage,
    "CE_Passthrough": Passthrough,
    "CE_MaskAndLatent": MaskAndLatent,
    "CE_Segfault": Segfault,
    "CE_Raise": Raise,
    "CE_SlowSteps": SlowSteps,
    "CE_StuckNative": StuckNative,
    "CE_LoadKernel": LoadKernel,
    "CE_LoadBigModel": LoadBigModel,
    "CE_UseBigModel": UseBigModel,
    "CE_UseKernel": UseKernel,
    "CE_SleepStamp": SleepStamp,
    "CE_SaveImagePNG": SaveImagePNG,
    "CE_Lazy": Lazy,
}
NODE_DISPLAY_NAME_MAPPINGS = {"CE_InvertImage": "Invert image (isolated, numpy)"}
