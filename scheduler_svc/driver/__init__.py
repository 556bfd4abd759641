"""The step loop on its own thread and what it calls: inbox, admission, the worker client, outbox, observers."""
