"""memlm.train"""
