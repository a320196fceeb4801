"""The fleet: the registry of workers, their load and health, and the service workers register and
heartbeat with."""
