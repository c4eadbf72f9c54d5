"""The environment memory service: every environment ever designed, and how the agent did on it.

Public API for other services: ``services.memory.service.MemoryService`` (in-process, embedded
mode) and ``services.memory.grpc_client.MemoryClient`` (distributed mode) expose the same async
methods; the records they take and return live in ``services.memory.core.records``.
"""
