"""Exports of drafter checkpoints for other engines: `gguf` (llama.cpp's DFlash speculative decoding) and `vllm`
(vLLM's `method: "dflash"`, drafter and target folders)."""
