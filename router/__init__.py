"""The router process (no torch): front doors, one request's life, policy and the fleet; `server`
wires them and serves."""
