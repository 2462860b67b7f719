"""The target runtime: a Llama-family model (its architectures, one row each in config.py) loaded from a Hugging Face
checkpoint or straight from a GGUF's blocks (registry.py, gguf_weights.py) and run on our kernels or torch's
(model.py), with its tokenizer (text_codec.py)."""
