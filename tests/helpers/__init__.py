"""Shared test helpers: tiny configs and drivers of subprocess runs."""
