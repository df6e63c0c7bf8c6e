"""Load and save: parallelize, reading checkpoints a slice at a time, their integrity, export and adapters."""
