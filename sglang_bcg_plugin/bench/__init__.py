"""``sglang-bcg bench``: capture a synthetic decoder (or Llama) with every backend, in each output mode."""
