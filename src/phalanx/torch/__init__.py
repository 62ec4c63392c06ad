"""phalanx.torch."""
