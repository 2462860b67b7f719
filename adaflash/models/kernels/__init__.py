"""Our own CPU kernels (built from source on first use, cached per machine), the quantization formats they read,
and the choice between them and torch's."""
