"""The model itself: config, families, weight names and formats, the linear kernels' modules, the transformer."""
