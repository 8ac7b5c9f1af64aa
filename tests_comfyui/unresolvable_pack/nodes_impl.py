class Never:
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "comfy-env/tests"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def run(self):
        return (0,)


NODE_CLASS_MAPPINGS = {"CE_NeverBuilt": Never}
