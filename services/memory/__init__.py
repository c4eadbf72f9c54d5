"""The environment memory service: every environment ever designed, and how the agent did on it.

Public API for other services: ``services.memory.service.MemoryService`` (in-process, embedded
mode) and ``spade.memory.client.MemoryClient`` (distributed mode) expose the same async
methods; the records they take and return, the errors they raise and the client itself live in the
shared package ``spade.memory``.
"""
