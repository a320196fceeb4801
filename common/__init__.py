"""What every process of the cluster shares: the gRPC server bootstrap, proto <-> domain
conversions, logging, and a client of the public API (status and streaming: the launcher, the
deployer and `pdserve client` use it)."""
