"""Model definitions (Flax NNX) and checkpoint loaders."""
