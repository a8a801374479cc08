"""The runtime: expert store, pinned pool, expert cache, prompt loan, CPU share and the executor that drives them.

Side effects live here and in backends only; everything the runtime sizes comes from a `Plan`.
"""
