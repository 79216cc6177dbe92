"""trainguard.diagnosis."""
