"""Nodes of the benchmark chain: an IMAGE through six nodes, one of which loads an object that
stays in the worker (a kept output, registered with ComfyUI's model manager) and two use it.
Plain tensor arithmetic (torch or numpy alike), no ComfyUI imports: the same module runs
in-process for the comparison."""


class Kernel:
    def __init__(self, scale):
        self.scale = scale

    def apply(self, image):
        return image * self.scale


class LoadKernel:
    CATEGORY = "bench"
    RETURN_TYPES = ("BENCH_KERNEL",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"scale": ("FLOAT", {"default": 1.0})}}

    def run(self, scale):
        return (Kernel(scale),)


class UseKernel:
    CATEGORY = "bench"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"kernel": ("BENCH_KERNEL",), "image": ("IMAGE",)}}

    def run(self, kernel, image):
        return (kernel.apply(image),)


class Invert:
    CATEGORY = "bench"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def run(self, image):
        return (1.0 - image,)


class GrowMaskBlur:
    """A multi-threaded torch node, as a mask grow with blur: max-pool to grow the mask, then
    a separable Gaussian blur (torch's intra-op threads do the work)."""

    CATEGORY = "bench"
    RETURN_TYPES = ("MASK",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"mask": ("MASK",), "grow": ("INT", {}), "blur": ("INT", {})}}

    def run(self, mask, grow, blur):
        import torch
        import torch.nn.functional as F

        with torch.inference_mode():
            x = mask.reshape(-1, 1, *mask.shape[-2:])
            x = F.max_pool2d(x, 2 * grow + 1, stride=1, padding=grow)
            t = torch.arange(-blur, blur + 1, dtype=x.dtype)
            g = torch.exp(-(t * t) / (2.0 * (blur / 2.0) ** 2))
            g = g / g.sum()
            x = F.conv2d(x, g.reshape(1, 1, 1, -1), padding=(0, blur))
            x = F.conv2d(x, g.reshape(1, 1, -1, 1), padding=(blur, 0))
            return (x.reshape(mask.shape),)


NODE_CLASS_MAPPINGS = {
    "BenchLoadKernel": LoadKernel,
    "BenchUseKernel": UseKernel,
    "BenchInvert": Invert,
    "BenchGrowMaskBlur": GrowMaskBlur,
}
