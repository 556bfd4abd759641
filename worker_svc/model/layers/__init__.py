"""The layer operations a family's decoder is written over; each picks its implementation once, at load."""
