"""Analyses of the papers' figures."""
