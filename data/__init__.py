"""memlm.data"""
