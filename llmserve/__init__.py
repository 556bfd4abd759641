"""llmserve: command-line entry points."""
