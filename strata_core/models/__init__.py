"""Models: the spec the planner reads, presets, GGUF files, weights and synthetic generation."""
