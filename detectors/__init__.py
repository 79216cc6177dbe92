"""trainguard.detectors"""
