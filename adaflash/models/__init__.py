"""The networks and their files, in rooms that import only downward:

- files.py: safetensors, config.json and the user cache;
- device/: where models run (the one device decision), what the CPU is, memory, the CUDA path checked without a GPU;
- kernels/: our CPU kernels, the quantization formats they read (quant.py, one row a format) and the choice between
  them and torch's;
- layers.py: the functional pieces the target and the drafters share;
- kv_cache/: the KV cache and the ragged batch that addresses it;
- targets/: the target runtime, its architectures (one row each), GGUF and checkpoint loading, its tokenizer;
- drafters/: the DFlash drafters, their checkpoints and draft vocabularies, and the length heads.
"""
