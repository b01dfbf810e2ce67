"""Per-family walk scripts: async Python over component calls (see mstar_common/walk_api.py)."""
