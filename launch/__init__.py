"""memlm.launch"""
