"""One request's life in the cluster: its deadline and calls, the worker clients, the events it
yields, and the orchestrator that reserves, prefills, decodes, retries and migrates."""
