"""Generated gRPC stubs for the ``spade.v1`` protos (see ``spade.protogen``)."""
