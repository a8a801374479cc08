"""The built-in backends, always present: cpu (the numpy reference) and sim (a simulated device)."""
