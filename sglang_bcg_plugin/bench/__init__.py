"""``sglang-bcg bench``: capture a synthetic decoder with every backend, sharing off and on."""
