"""A V3 node: ``comfy_entrypoint()`` returns a ``ComfyExtension`` listing ``io.ComfyNode``
classes. In the env, ``comfy_api.latest`` is comfy-env's stand-in (the env has no ComfyUI)."""

import os

import numpy as np
from comfy_api.latest import ComfyExtension, io


class ScaleImageV3(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="CE_ScaleImageV3",
            display_name="Scale image (isolated, V3)",
            category="comfy-env/examples",
            inputs=[
                io.Image.Input("image"),
                io.Float.Input("factor", default=0.5, min=0.0, max=10.0, step=0.01),
            ],
            outputs=[io.Image.Output(), io.String.Output(display_name="kind")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, image, factor):
        out = (np.asarray(image, dtype=np.float32) * np.float32(factor)).astype(np.float32)
        return io.NodeOutput(out, "%s node=%s" % (type(image).__module__, cls.hidden.unique_id))


Thing = io.Custom("CE_V3_THING")  # a custom socket type: its values stay in the worker


class Counted:
    def __init__(self, start):
        self.value = start
        self.pid = os.getpid()


class MakeThingV3(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="CE_MakeThingV3",
            category="comfy-env/examples",
            inputs=[io.Int.Input("start", default=0)],
            outputs=[Thing.Output()],
        )

    @classmethod
    def execute(cls, start):
        return io.NodeOutput(Counted(start))


class BumpThingV3(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="CE_BumpThingV3",
            category="comfy-env/examples",
            inputs=[Thing.Input("thing"), io.Int.Input("salt", default=0)],
            outputs=[io.String.Output()],
        )

    @classmethod
    def execute(cls, thing, salt):
        thing.value += 1
        return io.NodeOutput("pid=%d value=%d" % (thing.pid, thing.value))


class V3Extension(ComfyExtension):
    async def get_node_list(self):
        return [ScaleImageV3, MakeThingV3, BumpThingV3]


async def comfy_entrypoint():
    return V3Extension()
