"""Embedded mode: every role of SPADE in one process (``spade run``)."""
