"""Our own CPU kernels (built from source on first use, cached per machine) and the choice between them and torch's."""
