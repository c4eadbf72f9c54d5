"""spade eval and the pool metrics with the real model and the real sandbox."""
