"""trainguard.actions"""
