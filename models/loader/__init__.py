"""Checkpoint loaders: Hugging Face directories, GGUF files, dummy weights."""
