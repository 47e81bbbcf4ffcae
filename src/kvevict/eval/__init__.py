"""Evaluation protocols: each answers one question about a policy at a budget."""
