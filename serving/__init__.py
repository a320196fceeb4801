"""What both worker roles share: the engine's step loop on its own thread, the admission gate,
worker metrics and options, the link to the router (registration + heartbeats) and start-up."""
