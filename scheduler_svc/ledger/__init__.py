"""The Redis ledger: the step commit, its codec and Lua scripts, Redis high availability, the lease."""
