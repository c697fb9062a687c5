"""Row-sharded tables: placement of state on meshes, routing rows to their owners, the routed
step, apply and lookup, and their partitioning under Auto axes."""
