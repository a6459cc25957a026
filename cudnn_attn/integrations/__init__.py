"""Integrations with other libraries (each module imports its library on first use)."""
