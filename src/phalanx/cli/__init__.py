"""phalanx.cli."""
