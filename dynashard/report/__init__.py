"""What a person sees: the plan table, compile progress, and every rank's program simulated for explain(verify=True)."""
