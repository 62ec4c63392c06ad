"""phalanx.spark."""
