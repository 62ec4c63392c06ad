"""phalanx.job."""
