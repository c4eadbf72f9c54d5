"""Talking to the environment memory: its records, its errors, its wire translation and its gRPC client.

Shared by the memory service itself (``services/memory``) and every service that uses it (designer,
rollout, learner, the embedded run):

- ``spade.memory.records``: the plain records the memory stores and returns;
- ``spade.memory.errors``: its domain errors (``EnvironmentNotFound``, ``InvalidArgument``);
- ``spade.memory.wire``: records to ``spade.v1.memory_pb2`` messages and back (server and client);
- ``spade.memory.client.MemoryClient``: the memory's API over gRPC, with the same async methods and
  errors as the in-process ``services.memory.service.MemoryService`` (it sends the caller's key);
- ``spade.memory.runspec``: ``fetch_run_spec`` (how a service reads the run spec at start) and
  ``load_spec_file`` (a YAML/JSON spec file).
"""
