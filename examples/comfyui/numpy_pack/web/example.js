// A front-end extension of the example pack: ComfyUI serves WEB_DIRECTORY from the pack's
// __init__.py (which runs in the server) whether its nodes are isolated or not.
console.log("comfy-env example pack loaded");
