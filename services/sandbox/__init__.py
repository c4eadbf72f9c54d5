"""The sandbox service: runs untrusted code (env sessions, validation, plain execution) in isolation."""
