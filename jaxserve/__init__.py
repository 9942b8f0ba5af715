"""jaxserve: an LLM serving engine on JAX/XLA."""
