"""What both worker roles share: the engine's step loop on its own thread, proto <-> domain
conversion, the gRPC server bootstrap and the link to the router (registration + heartbeats)."""
