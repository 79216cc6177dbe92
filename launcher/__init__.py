"""trainguard.launcher."""
