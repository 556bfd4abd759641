"""The CPU backend's process side: which cores the worker binds to, and how many threads a step uses."""
