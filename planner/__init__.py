"""The P:D planner: a discrete-event model of a cluster serving a workload, and the split of
workers it recommends for an SLO."""
