"""phalanx.launch."""
