"""One adapter module per suite: reasoning-gym, bfcl-multi-turn, pool."""
