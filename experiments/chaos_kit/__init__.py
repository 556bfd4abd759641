"""The parts of experiments/chaos.py: the stack it breaks (stack.py, forwarder.py), the load it keeps up
(load.py) and what it samples and checks (checks.py)."""
