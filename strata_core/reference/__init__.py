"""The numpy reference: the oracle every backend is checked against."""
