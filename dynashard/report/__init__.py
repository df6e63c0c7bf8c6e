"""What a person sees: the plan table, compile progress, explain and its simulated verification."""
