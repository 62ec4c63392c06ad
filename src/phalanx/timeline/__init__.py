"""phalanx.timeline."""
