"""Embedded mode (``spade run``): every role of SPADE in one process.

A composition root, beside the services it wires: it builds each service's settings from one
``RunSettings`` and connects the services' own wiring to in-process parts (the isolated sandbox
pool, a SQLite memory, the in-process queue, the embedded inference server). Nothing in a service
knows it runs here.
"""
