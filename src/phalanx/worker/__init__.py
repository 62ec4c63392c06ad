"""phalanx.worker."""
