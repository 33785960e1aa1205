"""Squall: placeholder, replaced below."""
