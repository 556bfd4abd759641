"""The scheduling core: plain data in, plain data out (no grpc, redis, torch or protos imports)."""
