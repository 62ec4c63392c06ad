"""phalanx.compat."""
