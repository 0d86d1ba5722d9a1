"""Optimizers and lr schedules (as torch keeps `optim/` and `lr_scheduler` together): the factory
that builds them from the config (factory.py), Lamb, 1-bit Adam, 0/1 Adam, 1-bit Lamb and the
error-feedback 1-bit all-reduce they share (onebit_allreduce.py), DeepSpeed's lr schedules.

Above zero/ and comm/, beside runtime/ (which steps what factory.py builds); imports neither
runtime/ nor checkpoint/.
"""
