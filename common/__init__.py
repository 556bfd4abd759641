"""Helpers both services use (TLS, tracing, gRPC auth, configuration errors). Imports no service and no CLI code."""
