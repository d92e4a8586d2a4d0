"""Compute kernels: each op has a Triton kernel and a plain-torch reference of the same
signature. Imports only torch and triton."""
