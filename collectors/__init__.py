"""trainguard.collectors"""
