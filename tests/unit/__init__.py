"""Unit tests: no processes, no Redis, no model weights; the whole directory runs in well under a minute."""
