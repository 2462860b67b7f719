"""Exports of drafter checkpoints for other engines: `gguf` (llama.cpp's DFlash speculative decoding)."""
