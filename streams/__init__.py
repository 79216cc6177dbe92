"""trainguard.streams"""
