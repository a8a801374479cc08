"""Settings: one typed StrataSettings from flags, environment, legacy variables, TOML and defaults."""
