"""Benchmarks of the stages against their references (README: Benchmarks); run as scripts."""
