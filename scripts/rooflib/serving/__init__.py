"""Serving: profiles that start a vLLM or SGLang server."""
