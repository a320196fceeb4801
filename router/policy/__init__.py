"""The router's policies, plain classes over ints: placement, where a prompt is prefilled, and
admission to the router's queue."""
