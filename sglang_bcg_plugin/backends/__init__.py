"""Built-in backends: one module each, each ending with its registration hookimpl."""
