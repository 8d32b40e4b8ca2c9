"""memlm.evals"""
