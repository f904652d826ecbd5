"""Sizing: model configs, GPU memory and KV cache (vram), and the roofline physics."""
