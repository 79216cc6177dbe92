"""trainguard.apps."""
