"""Who may talk to whom: the cluster token, TLS and mutual TLS settings, throwaway certificates,
and the secure directory of `launch --secure`."""
