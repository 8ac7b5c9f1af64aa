"""A node pack for ``bench_comfyui.py``'s chain of isolated nodes (never loaded by ComfyUI)."""
