"""Deployment helpers: the local all-in-one stack and its configuration."""
