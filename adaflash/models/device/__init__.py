"""Where models run: the one device decision (placement.py), what the CPU is (cpu.py), memory (memory.py), and the
CUDA path checked on a machine without a GPU (fake_cuda.py)."""
